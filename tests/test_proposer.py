"""The proposer driven through vLLM's interface by hand: rows condensed,
preempted and resumed, chunked prefills and steps with no propose call."""

import numpy as np
import pytest

import consensus_spec
from consensus_spec import ConsensusProposer, consensus, engine_args
from consensus_spec.vllm import configured
from tests.stand_in import stand_in_config

PROMPT = [50, 51, 52, 53, 54]


class Engine:
    """Minimal stand-in for vLLM's input batch: rows of token buffers."""

    def __init__(self, proposer, max_len=200):
        self.p = proposer
        self.buf = np.zeros((8, max_len), dtype=np.int32)
        self.n = np.zeros(8, dtype=np.int32)

    def load(self, row, tokens):
        self.buf[row, :len(tokens)] = tokens
        self.n[row] = len(tokens)

    def append(self, row, tokens):
        self.buf[row, self.n[row]:self.n[row] + len(tokens)] = tokens
        self.n[row] += len(tokens)

    def step(self, sampled):
        for row, toks in enumerate(sampled):
            if toks:
                self.append(row, toks)
        return self.p.propose(sampled, self.n, self.buf)


def make(**options):
    options.setdefault("cost_model", "off")
    return ConsensusProposer(stand_in_config(k=4, max_model_len=200, max_num_seqs=8), **options)


def test_siblings_are_grouped_by_prompt_and_draft_from_each_other():
    p = make(min_prob=0.0)
    e = Engine(p)
    e.load(0, PROMPT)
    e.load(1, PROMPT)
    e.step([[1], [1]])
    e.step([[2, 3, 4], [2]])
    drafts = e.step([[5], [3]])
    assert drafts[1][:2] == [4, 5]
    assert p.rows.paths_started == 2 and p.drafter.num_groups == 1


def test_condensed_rows_keep_their_paths():
    p = make(min_prob=0.0)
    e = Engine(p)
    for r in range(3):
        e.load(r, PROMPT + [9 + r])  # three different prompts
    e.step([[1], [1], [1]])
    e.step([[2], [2], [2]])
    # row 0 finished; vLLM moves the last row (2) into the hole
    e.buf[0] = e.buf[2]
    e.n[0] = e.n[2]
    e.step([[3], [3]])
    assert p.rows.paths_started == 3  # no new path for the moved row
    assert p.rows.paths_moved == 1 and p.rows.paths_resumed == 0


def test_preempted_path_resumes_without_a_new_path():
    p = make(min_prob=0.0)
    e = Engine(p)
    e.load(0, PROMPT)
    e.load(1, [7] + PROMPT)
    e.step([[1], [1]])
    e.step([[2], [2, 3]])
    saved = e.buf[1].copy(), int(e.n[1])
    e.step([[4]])  # row 1 preempted: the batch shrinks
    e.buf[1], e.n[1] = saved  # resumed: recomputed, then samples a token
    e.step([[5], [6]])
    assert p.rows.paths_started == 2 and p.rows.paths_resumed == 1


def test_chunked_prefill_rows_get_no_draft_and_missed_steps_are_caught_up():
    p = make(min_prob=0.0)
    e = Engine(p)
    e.load(0, PROMPT)
    e.load(1, PROMPT[:3])  # still prefilling: nothing sampled
    assert e.step([[1], []])[1] == []
    e.load(1, PROMPT)
    e.step([[2], [1]])
    # two steps the engine ran without calling the drafter
    e.append(0, [3, 4])
    e.append(1, [2, 3])
    drafts = e.step([[5], [4]])
    assert p.rows.tokens_missed == 4
    assert p.rows.paths_started == 2
    assert drafts[1][:1] == [5]


def test_drafts_respect_k_and_max_model_len():
    p = ConsensusProposer(stand_in_config(k=3, max_model_len=12, max_num_seqs=8), min_prob=0.0,
                          cost_model="off")
    e = Engine(p)
    e.load(0, PROMPT)
    e.load(1, PROMPT)
    e.step([[1], [1]])
    e.step([[2, 3, 4, 5], [2]])
    drafts = e.step([[6], [3]])
    assert len(drafts[1]) == 3
    # row 0 holds 11 tokens of 12: no room for a draft
    assert drafts[0] == []


def two_groups(p, fault=None):
    """Rows 0-1 siblings of PROMPT, rows 2-3 siblings of another prompt, fed
    the same tokens; ``fault(step, args)`` may corrupt a copy of the inputs."""
    e = Engine(p)
    other = [60, 61, 62]
    for r, prompt in enumerate((PROMPT, PROMPT, other, other)):
        e.load(r, prompt)
    script = [[[1], [1], [7], [7]], [[2, 3, 4], [2], [8, 9], [8]], [[5], [3], [10], [9]],
              [[6], [4], [11], [10]], [[1], [5], [12], [11]], [[2], [6], [13], [12]]]
    out = []
    for step, sampled in enumerate(script):
        for row, toks in enumerate(sampled):
            e.append(row, toks)
        args = (sampled, e.n.copy(), e.buf.copy())
        if fault is not None:
            args = fault(step, args)
        out.append(p.propose(*args))
    return out


@pytest.mark.parametrize("kind", ["huge_id", "negative_id", "not_a_list", "past_buffer"])
def test_a_bad_row_sits_out_alone_and_other_groups_draft_unchanged(kind):
    def corrupt(step, args):
        sampled, n, buf = args
        if step == 2:  # row 1 (a sibling in group one) goes bad for one step
            if kind == "huge_id":
                buf[1, n[1] - 1] = 1 << 21
            elif kind == "negative_id":
                buf[1, n[1] - 1] = -5
            elif kind == "not_a_list":
                sampled = [sampled[0], None, sampled[2], sampled[3]]
            else:
                n[1] = buf.shape[1] + 9
        return sampled, n, buf

    clean, faulty = make(min_prob=0.0), make(min_prob=0.0)
    a, b = two_groups(clean), two_groups(faulty, corrupt)
    assert faulty.num_failures == 0 and faulty.num_resets == 0
    assert faulty.rows.rows_rejected == 1
    assert b[2][1] == [] and a[2][1] != []  # the bad row alone drafts nothing that step
    for step in range(len(a)):              # the other group never notices
        assert b[step][2:] == a[step][2:]
    assert b[2][0] == a[2][0]               # nor does its sibling that step
    assert faulty.drafter.num_groups == 2 and faulty.rows.paths_started == 4
    assert faulty.rows.paths_resumed == 1   # the bad row's path came back, in its group
    assert b[-1][1] != []


def test_a_failed_step_regroups_rows_in_flight_with_their_siblings():
    """A failure inside the drafter (after row tracking) rebuilds the tries,
    not the tracker: every row keeps its path and group, and its output so far
    is back in its group's trie, so siblings draft from each other at once."""
    clean, faulty = make(min_prob=0.0), make(min_prob=0.0)
    a = two_groups(clean)
    groups = {}

    def fail_once(step, args):
        if step == 3:
            groups.update({r: faulty.drafter.group_of(int(faulty.rows._path[r]))
                           for r in range(4)})
            real = faulty.drafter.extend_and_draft

            def boom(*x, **k):
                faulty.drafter.extend_and_draft = real
                raise RuntimeError("injected")
            faulty.drafter.extend_and_draft = boom
        return args

    b = two_groups(faulty, fail_once)
    assert faulty.num_failures == 1 and faulty.num_regroups == 1 and not faulty.disabled
    assert b[3] == [[], [], [], []]
    assert {r: faulty.drafter.group_of(int(faulty.rows._path[r])) for r in range(4)} == groups
    assert faulty.rows.paths_started == 4 and faulty.drafter.num_groups == 2
    assert [len(d) > 0 for d in b[4]] == [len(d) > 0 for d in a[4]]
    assert b[5] == a[5]  # the tries hold the same n-grams again


def test_a_second_failure_in_a_row_rebuilds_everything():
    p = make(min_prob=0.0)

    def fail_twice(step, args):
        if step in (3, 4):
            def boom(*x, **k):
                raise RuntimeError("injected")
            p.drafter.extend_and_draft = boom
        return args

    tracker = p.rows
    two_groups(p, fail_twice)
    assert p.num_failures == 2 and p.num_resets == 2 and p.num_regroups == 1
    assert p.rows is not tracker and p.rows.paths_started == 4  # every row started afresh


def test_consensus_is_the_one_line_config_and_options_go_in_additional_config():
    assert consensus == {"method": "custom_class", "model": "consensus_spec.ConsensusProposer",
                         "num_speculative_tokens": 8}
    args = engine_args(5, min_prob=0.25, max_depth=10)
    assert args["speculative_config"] == {**consensus, "num_speculative_tokens": 5}
    cfg = stand_in_config(k=5, max_model_len=100, max_num_seqs=4)
    cfg.additional_config = args["additional_config"]
    proposer = ConsensusProposer(cfg)
    assert proposer.drafter.options.min_prob == 0.25 and proposer.drafter.options.max_depth == 10


def test_the_old_class_name_channel_says_what_to_write_instead():
    with pytest.raises(AttributeError, match="engine_args"):
        consensus_spec.speculative_config  # noqa: B018 - 0.1's API
    with pytest.raises(AttributeError, match="additional-config"):
        getattr(configured, "min_prob_0p4__max_depth_12")  # what vLLM imports for an old config


def test_engine_args_carry_options_in_additional_config(tmp_path):
    table = tmp_path / "costs.jsonl"
    table.write_text("".join(f'{{"B": {b}, "q": {q}, "ms": {1 + b * q / 100}}}\n'
                             for b in (8, 64) for q in (1, 3, 5)))
    args = engine_args(5, min_prob=0.25, cost_model=str(table), warmup=False)
    assert args["speculative_config"]["model"] == "consensus_spec.ConsensusProposer"
    assert args["additional_config"] == {"consensus_spec": {"min_prob": 0.25, "cost_model": str(table),
                                                            "warmup": False}}
    cfg = stand_in_config(k=5, max_model_len=100, max_num_seqs=4)
    cfg.additional_config = args["additional_config"]  # what vLLM hands the engine process
    proposer = ConsensusProposer(cfg)
    assert proposer.drafter.options.min_prob == 0.25 and proposer.warmup_s == 0.0
    assert proposer.budget is not None  # fitted to the table


def test_bad_options_fail_before_reaching_vllm():
    with pytest.raises(ValueError, match="unknown consensus_spec option"):
        engine_args(min_porb=0.3)
    with pytest.raises(TypeError, match="max_depth=8.0: expected int"):
        engine_args(max_depth=8.0)
    with pytest.raises(TypeError, match="expected int"):
        engine_args(max_depth="8")
    with pytest.raises(TypeError, match="expected bool"):
        engine_args(warmup=1)
    with pytest.raises(ValueError):
        engine_args(num_speculative_tokens=0)


def test_bad_additional_config_is_a_clear_error_at_engine_start():
    cfg = stand_in_config(k=5, max_model_len=100, max_num_seqs=4)
    cfg.additional_config = {"consensus_spec": {"max_dept": 8}}
    with pytest.raises(ValueError, match="unknown consensus_spec option"):
        ConsensusProposer(cfg)
    cfg.additional_config = {"consensus_spec": [1]}
    with pytest.raises(TypeError, match="JSON object"):
        ConsensusProposer(cfg)




def test_warm_up_steps_leave_no_counts_behind():
    """The made-up warm-up steps draft (they compile the kernels) but are no
    engine's steps: a fresh proposer reports nothing drafted or accepted."""
    p = ConsensusProposer(stand_in_config(k=4, max_model_len=200, max_num_seqs=8))
    assert p.warmup_s > 0
    c = p.counters()
    assert c["num_drafted"] == 0 and c["num_accepted"] == 0 and c["paths_started"] == 0


def test_counters_leave_the_engine_through_vllms_encoder_after_learning():
    """``collective_rpc`` sends counters() through vLLM's msgpack encoder,
    in the engine's output thread: a numpy scalar there raised, the thread
    died and every request after it hung (CI saw it). After steps that
    explore and run guard windows, every value is a plain Python one."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from tests.test_online_costs import drive

    p = ConsensusProposer(stand_in_config(k=8, max_model_len=200, max_num_seqs=64,
                                          options={"cost_model": "cpu_embedded", "warmup": False,
                                                   "remember_costs": False}))
    # a small batch whose drafts cost more than the prior says: a few steps explore
    drive(p.budget, lambda b, m: 8.0 + 0.8 * m, 2, 300, np.random.default_rng(0), throughput=True)
    assert p.budget.costs.steps_explored > 0  # the value that was a numpy scalar
    counters = p.counters()
    decoded = MsgpackDecoder().decode(MsgpackEncoder().encode(counters))
    assert decoded["learning_cost"]["explored_steps"] == p.budget.costs.steps_explored


def test_the_arena_is_resident_from_the_start_unless_told_otherwise():
    """commit_arena (default): the trie arena's pages are backed at
    construction, so a server's memory does not grow towards the bound as
    the arena fills; bounds() says what every counter stays within."""
    from tests.process_memory import resident_bytes

    def resident(p):
        forest = p.drafter.forest
        arrays = [forest._nodes, *forest._tables, forest._spare]
        return resident_bytes([[a.ctypes.data, a.nbytes] for a in arrays])

    committed = make(max_trie_nodes=200_000, warmup=False)
    lazy = make(max_trie_nodes=200_000, warmup=False, commit_arena=False)
    assert resident(committed) >= committed.drafter.arena_bytes * 0.99
    assert resident(lazy) < lazy.drafter.arena_bytes / 4
    c = committed.counters()
    assert c["bounds"]["trie_nodes"] == 200_000 and c["bounds"]["arena_bytes"] == c["arena_bytes"]
    assert c["bounds"]["parked_paths"] == 64 + 4 * 8 and c["bounds"]["path_slots"] == 128
    assert all(c[k] <= bound for k, bound in c["bounds"].items())
