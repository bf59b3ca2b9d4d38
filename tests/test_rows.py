"""RowTracker: which path is in which row, from token content alone, driven
the way vLLM's input batch changes (condense, preemption, missed steps)."""

import numpy as np
import pytest

from consensus_spec.vllm import row_kernels, rows as rows_module
from consensus_spec.vllm.rows import RowTracker

MASK = 2**64 - 1
MUL = 0x9E3779B97F4A7C15


def reference_hash(tokens) -> int:
    """The tracker's sequence hash, written out in Python integers."""
    h = 0
    for t in tokens:
        h = ((h + int(t) + 1) * MUL) & MASK
        h ^= h >> 32
    return h


class Batch:
    """vLLM's token buffer and lengths, and a tracker recording each path's
    tokens as the drafter's forest would receive them."""

    def __init__(self, rows=8, width=64):
        self.buf = np.zeros((rows, width), np.int32)
        self.n = np.zeros(rows, np.int32)
        self.seqs = {}  # path -> its tokens as told to the drafter
        self.tracker = RowTracker(self._start, max_parked=10**6)

    def _start(self, prompt):
        path = len(self.seqs)
        self.seqs[path] = list(prompt)
        return path

    def load(self, row, tokens):
        self.buf[row] = 0
        self.buf[row, :len(tokens)] = tokens
        self.n[row] = len(tokens)

    def append(self, row, tokens):
        self.buf[row, self.n[row]:self.n[row] + len(tokens)] = tokens
        self.n[row] += len(tokens)

    def tokens(self, row):
        return self.buf[row, :self.n[row]].tolist()

    def move(self, src, dst):
        """vLLM's condense: the last row fills a hole."""
        self.load(dst, self.tokens(src))

    def step(self, sampled, check=True):
        """Append ``sampled`` and call the tracker; returns {row: (path, begin, contiguous)}."""
        for row, toks in enumerate(sampled):
            self.append(row, toks)
        update = self.tracker.update(sampled, self.n, self.buf)
        out = {}
        for i, path, begin, end, contiguous in zip(*(a.tolist() for a in update)):
            row = self.buf[i, :end].tolist()
            if check:  # the path's tokens so far are the row's: it is this row's path
                assert self.seqs[path] == row[:begin], f"row {i} got path {path} of other tokens"
            self.seqs[path] = row
            out[i] = (path, begin, contiguous)
        return out

    def path(self, row):
        return int(self.tracker._path[row])


def test_steady_state_keeps_paths_contiguous():
    b = Batch()
    b.load(0, [5, 6, 7])
    b.load(1, [8, 9])
    first = b.step([[1], [1]])
    assert {r: p for r, (p, _, _) in first.items()} == {0: 0, 1: 1}
    for k in range(5):
        out = b.step([[2, 3], [4]])
        assert out[0][0] == 0 and out[1][0] == 1
        assert out[0][2] and out[1][2]
    assert b.tracker.paths_started == 2 and b.tracker.paths_moved == 0


def test_missed_steps_are_caught_up_in_the_same_row():
    b = Batch()
    b.load(0, [5, 6, 7])
    b.load(1, [8, 9])
    b.step([[1], [1]])
    b.append(0, [2, 3])  # a step the drafter did not see
    b.append(1, [2])
    out = b.step([[4], [3]])
    assert out[0] == (0, 4, False) and out[1] == (1, 3, False)
    assert b.tracker.tokens_missed == 3 and b.tracker.paths_started == 2


def test_moved_rows_keep_their_paths():
    b = Batch()
    for r in range(3):
        b.load(r, [10 + r, 20, 21])
    b.step([[1], [1], [1]])
    b.move(2, 0)  # row 0 finished; the last row fills its hole
    out = b.step([[2], [2]])
    assert out[0] == (2, 4, False) and out[1] == (1, 4, True)
    assert b.tracker.paths_moved == 1 and b.tracker.paths_started == 3


def two_prompts_that_meet(b):
    """Rows 1 and 2 hold different prompts whose paths reach equal length
    with the same last four tokens; row 0 a third prompt."""
    b.load(0, [90, 91, 92, 93])
    b.load(1, [70, 71, 72, 73])
    b.load(2, [80, 81, 82, 83])
    b.step([[5], [5], [5]])
    b.step([[6], [6, 7, 8], [6, 7, 8]])
    assert b.tokens(1)[-4:] == b.tokens(2)[-4:] and b.n[1] == b.n[2]
    return b.path(1), b.path(2)


def test_moved_row_is_not_taken_for_another_prompts_path_of_equal_length_and_tail():
    # row 1 finishes and row 2 moves into its hole: row 1 now looks exactly
    # like its finished path continuing (same length, same last tokens)
    b = Batch()
    a, c = two_prompts_that_meet(b)
    b.move(2, 1)
    out = b.step([[7], [9]], check=False)
    assert out[1][0] == c, "the moved row continued the finished path of another prompt"
    assert b.tracker.paths_moved == 1 and b.tracker.paths_started == 3
    assert b.tracker.parked() == {(8, reference_hash([70, 71, 72, 73, 5, 6, 7, 8])): [a]}


def test_moved_row_after_missed_steps_is_not_taken_for_another_prompts_path():
    b = Batch()
    a, c = two_prompts_that_meet(b)
    b.append(2, [9, 9])  # missed steps, during which row 1 finished and row 2 moved
    b.move(2, 1)
    out = b.step([[7], [9]], check=False)
    assert out[1] == (c, 8, False)
    assert b.tracker.paths_moved == 1 and b.tracker.tokens_missed == 2


def test_a_path_that_advanced_into_a_finished_rows_length_and_tail_is_still_found():
    # during missed steps row 2's path grows to exactly what row 1's finished
    # path was (length and last four tokens), then moves into row 1
    b = Batch()
    b.load(0, [90, 91, 92, 93])
    b.load(1, [70, 71, 72, 73, 74, 75])
    b.load(2, [80, 81, 82, 83])
    b.step([[5], [5], [5]])
    b.step([[6], [6, 7, 8], [6]])  # row 1: 10 tokens ending 5 6 7 8; row 2: 6 tokens
    a, c = b.path(1), b.path(2)
    b.append(0, [1, 2])  # missed steps: every running row advances
    b.append(2, [5, 6, 7, 8])  # row 2 reaches 10 tokens ending 5 6 7 8
    assert b.tokens(2)[-4:] == b.tokens(1)[-4:] and b.n[1] == b.n[2]
    b.move(2, 1)
    out = b.step([[7], [9]], check=False)
    assert out[1] == (c, 6, False) and a not in (p for p, _, _ in out.values())
    assert out[0] == (b.path(0), 6, False)


def test_parked_paths_resume_by_their_whole_sequence():
    # rows 1 and 2 are preempted together with equal length and tail: each
    # must come back as its own path, whichever resumes first
    b = Batch()
    a, c = two_prompts_that_meet(b)
    b.step([[7]])  # the batch shrinks to row 0
    b.load(1, [70, 71, 72, 73, 5, 6, 7, 8])  # row 1's prompt resumes first ...
    out = b.step([[8], [9]], check=False)
    assert out[1][0] == a, "resumed as the other prompt's parked path"
    b.load(2, [80, 81, 82, 83, 5, 6, 7, 8])  # ... then row 2's
    out = b.step([[9], [9], [9]], check=False)
    assert out[2][0] == c
    assert b.tracker.paths_resumed == 2 and b.tracker.paths_started == 3


def test_new_prompt_with_a_parked_paths_length_and_tail_starts_its_own_path():
    b = Batch()
    a, c = two_prompts_that_meet(b)
    b.step([[7], [7]])  # row 2 preempted: parked at 8 tokens ending 5 6 7 8
    b.load(2, [60, 61, 62, 63, 5, 6, 7, 8])  # a new request, 8 prompt tokens
    out = b.step([[8], [8], [1]], check=False)
    assert out[2][0] not in (a, c)
    assert b.tracker.paths_started == 4 and b.tracker.paths_resumed == 0


def test_parked_path_resumes_after_missed_tokens():
    b = Batch()
    a, c = two_prompts_that_meet(b)
    b.step([[7], [7]])  # row 2 preempted
    b.load(2, [80, 81, 82, 83, 5, 6, 7, 8, 4, 4])  # resumed 2 tokens further on
    out = b.step([[8], [8], [1]])
    assert out[2] == (c, 8, False)
    assert b.tracker.paths_resumed == 1 and b.tracker.tokens_missed == 2


def test_identical_siblings_are_interchangeable():
    b = Batch()
    for r in range(3):
        b.load(r, [5, 6, 7])
    b.step([[1], [1], [1]])
    b.step([[2], [2], [2]])
    b.move(2, 0)
    b.step([[3], [3]])  # checks each path's tokens match its row's
    assert b.tracker.paths_started == 3 and b.tracker.paths_resumed == 0


def test_incremental_hash_equals_hash_from_scratch():
    rng = np.random.default_rng(0)
    b = Batch(rows=4, width=400)
    for r in range(4):
        b.load(r, rng.integers(0, 50_000, rng.integers(1, 30)).tolist())
    for _ in range(60):
        sampled = [rng.integers(0, 50_000, rng.integers(0, 5)).tolist() for _ in range(4)]
        b.step(sampled)
        for r in range(4):
            if b.tracker._lens[r] >= 0:
                assert int(b.tracker._hash[r]) == reference_hash(b.tokens(r)[:b.tracker._lens[r]])
    assert b.tracker.paths_started == 4 and b.tracker.paths_moved == 0
    scratch = np.empty(401, np.uint64)
    for r in range(4):  # the compiled all-prefixes pass agrees at every length
        row_kernels._prefixes(b.buf, r, int(b.n[r]), scratch)
        tokens = b.tokens(r)
        for n in range(0, len(tokens) + 1, 7):
            assert int(scratch[n]) == reference_hash(tokens[:n])
    # rows done one after another keep what they share with the row before
    shared = np.zeros((5, 40), np.int32)
    shared[:, :30] = rng.integers(0, 50_000, 30)  # one prompt, as new siblings have
    shared[:, 30:] = rng.integers(0, 50_000, (5, 10))
    shared[3, 5] += 1  # differs early from the row before
    ends = [40, 33, 30, 40, 12]
    last, last_end = -1, 0  # no row before the first
    for r, end in enumerate(ends):
        row_kernels._prefixes(shared, r, end, scratch, last, last_end)
        assert [int(scratch[n]) for n in range(end + 1)] == [
            reference_hash(shared[r, :n].tolist()) for n in range(end + 1)]
        last, last_end = r, end
    assert reference_hash([0, 1]) != reference_hash([1, 0])
    assert reference_hash([2**31 - 1]) == int(row_kernels._extend(
        np.uint64(0), np.array([[2**31 - 1]], np.int32), 0, 0, 1))


def test_rows_with_inconsistent_counts_or_lengths_are_skipped_alone():
    b = Batch(rows=4, width=16)
    for r in range(4):
        b.load(r, [10 + r, 20])
    b.step([[1], [1], [1], [1]])
    b.step([[2], [2], [2], [2]])
    b.append(0, [3])
    b.n[1] = 17           # past the buffer's end
    b.n[2] = 2            # fewer tokens than this step sampled
    b.n[3] = -5
    update = b.tracker.update([[3], [4], [7, 7, 7], [8]], b.n, b.buf)
    assert update.rows.tolist() == [0] and update.paths.tolist() == [0]
    assert update.contiguous.tolist() == [True]
    assert b.tracker.rows_rejected == 3
    assert b.tracker._counts.tolist() == [1, 0, 0, 0]
    # back to sense: each row resumes its own parked path from the buffer
    b.n[1:] = 4
    for r in range(4):
        b.append(r, [9])
    update = b.tracker.update([[9]] * 4, b.n, b.buf)
    assert update.paths.tolist() == [0, 1, 2, 3]
    assert update.contiguous.tolist() == [True, False, False, False]
    assert b.tracker.paths_resumed == 3 and b.tracker.paths_started == 4


def test_shapes_that_do_not_fit_raise_and_change_nothing():
    b = Batch(rows=2, width=16)
    b.load(0, [1, 2])
    b.load(1, [3, 4])
    b.step([[5], [6]])
    t = b.tracker
    with pytest.raises(ValueError):
        t.update([[1], [1]], b.n[:1], b.buf)  # num_tokens shorter than the batch
    with pytest.raises(ValueError):
        t.update([[1], [1]], b.n, b.buf[0])  # not 2-D
    with pytest.raises(ValueError):
        t.update([[1], [1]], b.n, b.buf[:1])  # fewer rows than the batch
    with pytest.raises(ValueError):
        t.update([[1], [1]], b.n.astype(np.float64), b.buf)
    with pytest.raises(ValueError):
        t.update([[1], [1]], b.n, b.buf.astype(np.uint64))  # numba would mix it as float
    out = b.step([[7], [8]])
    assert out == {0: (0, 3, True), 1: (1, 3, True)}
    assert t.rows_rejected == 0
    assert t.update([], np.zeros(0), b.buf).rows.tolist() == []  # an empty batch is fine


def test_a_row_with_bad_ids_or_no_token_list_sits_out_alone():
    b = Batch(rows=3, width=16)
    b.tracker = RowTracker(b._start, max_parked=100, token_limit=100)
    for row, prompt in enumerate(([1, 2], [1, 2], [3, 4])):
        b.load(row, prompt)
    b.step([[5], [6], [7]])
    b.append(1, [100])                        # an id at the limit in row 1's new tokens
    b.append(0, [8])
    b.append(2, [9])
    update = b.tracker.update([[8], [100], [9]], b.n, b.buf)
    assert update.rows.tolist() == [0, 2] and update.contiguous.tolist() == [True, True]
    assert b.tracker.rows_rejected == 1
    b.buf[1, b.n[1] - 1] = 10                 # the row makes sense again: its path resumes
    b.append(0, [11])
    update = b.tracker.update([[11], None, []], b.n, b.buf)  # None: row 1 sits out again
    assert update.rows.tolist() == [0] and b.tracker.rows_rejected == 2
    b.buf[1, b.n[1]] = 12
    b.n[1] += 1
    update = b.tracker.update([[], [12], []], b.n, b.buf)
    assert update.rows.tolist() == [1] and b.tracker.paths_resumed == 1
    assert update.paths.tolist() == [1] and update.begins.tolist() == [3]  # from [1, 2, 6]
    b.load(2, [3, -4, 7])                     # a moved or new row reads every token: bad here
    update = b.tracker.update([[], [], [7]], b.n, b.buf)
    assert update.rows.tolist() == [] and b.tracker.rows_rejected == 3


def vllm_like_run(seed, steps=400, max_rows=6, width=512):
    """Requests of a few prompts over a tiny vocabulary (so different
    prompts' paths keep meeting at equal length and tail), finishing,
    preempted and resumed, condensed, with steps the drafter does not see.
    Every path's tokens must stay its row's (Batch.step checks). Layout
    changes happen only on steps the drafter sees; new and resumed requests
    are appended after the rows it saw, never into a row that just emptied
    (the hole the module docstring admits)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 3, rng.integers(2, 6)).tolist() for _ in range(4)]
    b = Batch(rows=max_rows, width=width)
    live, paused = [], []  # per live row: [tokens, target length]
    seen = True
    for step in range(steps):
        if seen and step % 2 == 0 and live:  # finish and preempt, then condense
            for r, req in enumerate(live):
                if len(req[0]) >= req[1] or rng.random() < 0.1:
                    live[r] = None
                    if len(req[0]) < req[1]:
                        paused.append(req)
            for hole in range(len(live)):  # vLLM's condense: the last rows fill the holes
                while live and live[-1] is None:
                    live.pop()
                if hole < len(live) and live[hole] is None:
                    live[hole] = live.pop()
        elif seen:  # admit: resumed requests first
            while len(live) < max_rows and rng.random() < 0.8:
                if paused and rng.random() < 0.6:
                    live.append(paused.pop(rng.integers(len(paused))))
                else:
                    prompt = prompts[rng.integers(len(prompts))]
                    live.append([list(prompt), len(prompt) + int(rng.integers(3, 60))])
        sampled = []
        for req in live:
            new = rng.integers(1, 3, rng.integers(1, 4)).tolist()
            req[0].extend(new)
            sampled.append(new)
        for r, req in enumerate(live):
            b.load(r, req[0][:len(req[0]) - len(sampled[r])])
        b.n[len(live):] = 0
        seen = rng.random() < 0.8 or not live
        if seen:
            b.step(sampled)
        else:
            for r, toks in enumerate(sampled):
                b.append(r, toks)
    return b.tracker


@pytest.mark.parametrize("seed", range(6))
def test_paths_never_cross_rows_in_a_vllm_like_run(seed):
    t = vllm_like_run(seed)
    assert t.paths_moved > 0 and t.paths_resumed > 0 and t.tokens_missed > 0


def test_garbage_never_reads_or_returns_past_the_buffer():
    rng = np.random.default_rng(1)
    b = Batch(rows=8, width=32)
    for step in range(2000):
        rows = int(rng.integers(0, 9))
        width = int(rng.choice([8, 32]))
        buf = rng.integers(0, 4, (8, width)).astype(np.int32)
        n = rng.integers(-3, width + 4, 8).astype(np.int32)
        sampled = [[1] * int(rng.integers(0, 6)) for _ in range(rows)]
        update = b.tracker.update(sampled, n, buf)
        assert np.all((0 <= update.begins) & (update.begins <= update.ends) & (update.ends <= width))
        assert np.all(update.ends - update.begins >= [len(sampled[i]) for i in update.rows])
    assert b.tracker.rows_rejected > 0 and b.tracker.paths_resumed > 0


class Released(Batch):
    """A Batch whose tracker has small caps and records what it releases."""

    def __init__(self, rows=8, width=64, max_parked=6, max_per_key=2):
        super().__init__(rows, width)
        self.released = []
        self.tracker = RowTracker(self._start, self.released.append, max_parked=max_parked,
                                  max_per_key=max_per_key)

    def finish_all(self):
        """Every row's request finishes: the batch is empty next step."""
        self.n[:] = 0
        self.tracker.update([], self.n, self.buf)

    def check_bounds(self):
        t = self.tracker
        held = set(t._path.tolist()) - {-1}
        by_key = t.parked()
        parked = [p for paths in by_key.values() for p in paths]
        assert t.num_parked == len(parked) <= t._max_parked
        assert all(1 <= len(paths) <= t._max_per_key for paths in by_key.values())
        assert t.num_parked_keys == len(by_key)
        # each path is held by a row, parked, or released, exactly one of them, once
        assert len(self.released) == len(set(self.released)) == t.paths_released
        assert not (set(self.released) & (held | set(parked))) and not held & set(parked)
        assert len(held) + len(parked) + len(self.released) == t.paths_started


def test_identical_finished_paths_are_capped_per_key_and_released():
    # one prompt sampled greedily, n=4: four identical paths, sent again and again
    b = Released(rows=4, max_parked=100, max_per_key=2)
    for request in range(30):
        for r in range(4):
            b.load(r, [5, 6, 7])
        for step in range(3):
            b.step([[1, 2]] * 4)
        b.finish_all()
        b.check_bounds()
        assert b.tracker.num_parked == 2 and b.tracker.num_parked_keys == 1
    assert b.tracker.paths_started == 4 * 30 and b.tracker.paths_released == 4 * 30 - 2
    assert b.released[:2] == [0, 1]  # the oldest copies go first


def test_parked_paths_are_capped_in_all_least_recently_parked_first():
    # short identical answers of different prompts: a key per prompt
    b = Released(rows=4, max_parked=5, max_per_key=2)
    keys = []
    for request in range(12):
        for r in range(4):
            b.load(r, [40 + request % 7, 6, 7])
        b.step([[1]] * 4)
        keys.append((4, reference_hash([40 + request % 7, 6, 7, 1])))
        b.finish_all()
        b.check_bounds()
        assert b.tracker.num_parked == min(2 * (request + 1), 5)
    # the parked are the newest: the last two prompts' two copies, one of the third last
    assert list(b.tracker.parked()) == keys[-3:]
    assert [len(p) for p in b.tracker.parked().values()] == [1, 2, 2]
    assert b.tracker.paths_released == 4 * 12 - 5


def test_identical_preempted_rows_resume_up_to_the_cap_then_start_new_paths():
    b = Released(rows=4, max_parked=100, max_per_key=2)
    for r in range(4):
        b.load(r, [5, 6, 7])
    b.step([[1]] * 4)
    b.step([[2]] * 4)
    ids = [b.path(r) for r in range(4)]
    b.n[1:] = 0
    b.step([[3]])  # rows 1-3 preempted: three identical paths
    b.check_bounds()
    assert b.tracker.num_parked == 2 and b.released == [ids[1]]
    for r in range(1, 4):  # all resume, one step further on
        b.load(r, [5, 6, 7, 1, 2, 3])
    out = b.step([[4]] * 4)  # checks every path's tokens are its row's
    assert b.tracker.paths_resumed == 2 and b.tracker.paths_started == 5  # and a new one
    assert {out[r][0] for r in (1, 2, 3)} >= {ids[2], ids[3]}
    assert b.tracker.num_parked == 0
    b.check_bounds()
    for _ in range(3):
        out = b.step([[5]] * 4)
        assert all(contiguous for _, _, contiguous in out.values())
        assert b.tracker.paths_started == 5


def test_the_caps_are_checked():
    with pytest.raises(ValueError):
        RowTracker(lambda prompt: 0, max_per_key=0)
    with pytest.raises(ValueError):
        RowTracker(lambda prompt: 0, max_parked=-1)


@pytest.mark.parametrize("variant", ["one_prompt", "short_answers"])
def test_repeated_requests_keep_parked_and_live_paths_bounded(variant):
    from tests import repeat_probe

    rows, n = 64, 8
    max_parked = 64 + 4 * rows  # what the proposer passes with max_num_seqs = rows
    if variant == "one_prompt":  # one key: the per-key cap binds
        make, parked_bound = repeat_probe.fixed_prompt_requests(), rows_module._MAX_PER_KEY
    else:  # 64 prompts, a key each: the total cap binds
        make, parked_bound = repeat_probe.short_answer_requests(), max_parked
    seen = []

    def check(proposer, finished):
        parked, live = proposer.rows.num_parked, proposer.drafter.num_paths
        assert parked <= parked_bound and live <= rows + parked
        assert proposer.drafter.num_live_groups <= live
        seen.append((parked, live))

    out = repeat_probe.run(requests=300, rows=rows, n=n, make=make, trace=False,
                           warmup_requests=0, on_request=check)
    assert len(seen) == 300 and out["acceptance"] > 0.9
    c = out["counters"]
    assert c["paths_started"] == 300 * n
    assert c["paths_released"] + c["live_paths"] == 300 * n  # live: in rows or parked
    assert c["num_parked"] == parked_bound  # full at the end: nothing leaked past the caps
    assert c["path_slots"] <= 2 * (rows + parked_bound)
    assert c["evictions"] == 0 and c["groups"] == (1 if variant == "one_prompt" else 64)
