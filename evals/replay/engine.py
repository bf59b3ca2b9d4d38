"""Replay recorded multi-sample traces through drafters as vLLM's model runner
calls them.

All paths of a problem enter after prefill, each with its first token. Each
step every row in the batch is passed to the drafter; a draft token is accepted
iff it equals the recorded next token (exact for point-mass drafts under vLLM's
rejection sampler), and the row advances by accepted + 1. Finished rows get one
last propose call, as in vLLM, then leave, and the batch is condensed the way
vLLM condenses it: the last row moves into each hole.

With ``scouts=S`` the first S paths of each problem run first; the others join
once that problem's scouts have finished, ahead of the next problem's scouts,
so the batch stays full and followers can draft from finished siblings.
Any other order of entry (waves with stop votes: :mod:`evals.adaptive.waves`)
is an ``admission`` object with ``pop()`` and ``finished(problem, path)``,
which may return running paths to abort: they leave the batch at once, their
tokens so far counted in ``aborted_tokens``.  An admission with
``progress(running)`` is shown the running paths' tokens so far after every
step, and may return running paths to abort as well.

A ``clock`` (:class:`VirtualClock`) is the time a drafter that reads one
sees: each verified step advances it by a step-cost table's T(B, q), and a
drafter call by the call's own time. The consensus proposer learns its step
costs from it, as it would from the engine's real steps.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

import numpy as np

from ..traces import Problem, max_len


@dataclass
class ReplayStats:
    method: str
    scouts: int
    row_steps: int = 0      # verified row-steps
    tokens: int = 0         # tokens produced by those steps
    drafted: int = 0
    accepted: int = 0
    aborted_tokens: int = 0  # tokens of paths aborted before they finished
    propose_rows: int = 0   # rows passed to the drafter, over all calls
    propose_s: float = 0.0  # drafter wall time
    call_us_per_row: list = field(default_factory=list, repr=False)  # per propose call
    step_rows: list = field(default_factory=list, repr=False)  # batch size per verified step
    step_drafted: list = field(default_factory=list, repr=False)  # draft tokens per step
    step_tokens: list = field(default_factory=list, repr=False)  # tokens the step produced
    drain_step: int | None = None  # the first step with no path left waiting to enter

    @property
    def median_us_per_row(self) -> float:
        return float(np.median(self.call_us_per_row)) if self.call_us_per_row else 0.0

    @property
    def tau(self) -> float:
        return self.tokens / max(self.row_steps, 1)

    @property
    def acceptance(self) -> float:
        return self.accepted / max(self.drafted, 1)

    @property
    def drafts_per_step(self) -> float:
        return self.drafted / max(self.row_steps, 1)

    @property
    def us_per_row(self) -> float:
        return self.propose_s * 1e6 / max(self.propose_rows, 1)

    def summary(self) -> dict:
        out = asdict(self)
        for key in ("call_us_per_row", "step_rows", "step_drafted", "step_tokens"):
            del out[key]
        return {**out, "tau": self.tau, "acceptance": self.acceptance,
                "drafts_per_step": self.drafts_per_step, "us_per_row": self.us_per_row,
                "median_us_per_row": self.median_us_per_row}

    def steady(self) -> dict:
        """τ and draft tokens per row-step over the steps run while paths were
        still waiting to enter (the batch as full as finishing paths let it
        be), and how many there were: the draining tail after the last path
        entered, at smaller batches with cheaper drafts, left out."""
        end = len(self.step_rows) if self.drain_step is None else self.drain_step
        row_steps = sum(self.step_rows[:end])
        return {"steps": end, "tau": sum(self.step_tokens[:end]) / max(row_steps, 1),
                "drafts_per_step": sum(self.step_drafted[:end]) / max(row_steps, 1)}


class VirtualClock:
    """Seconds as a proposer in a replay sees them: ``step_ms(rows, q)`` per
    verified step of ``rows`` rows with q tokens each, plus each drafter
    call's measured time."""

    def __init__(self, step_ms):
        self.step_ms = step_ms
        self.now = 0.0
        self._call_start = None

    def __call__(self) -> float:
        if self._call_start is not None:
            return self.now + time.perf_counter() - self._call_start
        return self.now

    def begin_call(self) -> None:
        self._call_start = time.perf_counter()

    def end_call(self) -> None:
        self.now = self()
        self._call_start = None

    def step(self, rows: int, drafted: int) -> None:
        if rows:
            self.now += self.step_ms(rows, 1.0 + drafted / rows) / 1000.0


class ReplayBatch:
    """The fields of vLLM's ``InputBatch`` that model-free proposers read."""

    def __init__(self, max_rows: int, max_len: int):
        self.token_ids_cpu = np.zeros((max_rows, max_len), dtype=np.int32)
        self.num_tokens_no_spec = np.zeros(max_rows, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_rows, dtype=np.int32)
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}


def _req_id(problem: int, path: int) -> str:
    return f"{problem}-{path}"


class _Row:
    __slots__ = ("req_id", "problem", "path", "seq", "n", "done")

    def __init__(self, problem: int, path: int, seq: list[int], n: int):
        self.req_id = _req_id(problem, path)
        self.problem, self.path, self.seq, self.n, self.done = problem, path, seq, n, False


class Queued:
    """Admission of the (problem, path) ``keys`` in order, aborting nothing."""

    def __init__(self, keys):
        self.queue = deque(keys)

    def pop(self):
        return self.queue.popleft() if self.queue else None

    def finished(self, problem: int, path: int) -> list[tuple[int, int]] | None:
        return None


class _Admission(Queued):
    """Order in which paths enter: followers of problems whose scouts are done
    first, then the next problem's scouts (all paths when scouts=0)."""

    def __init__(self, problems: list[Problem], scouts: int):
        self.problems, self.scouts = problems, scouts
        first = [len(p.completions) if scouts <= 0 else min(scouts, len(p.completions)) for p in problems]
        super().__init__((p, s) for p, f in enumerate(first) for s in range(f))  # the scouts, in order
        self.ready: deque[tuple[int, int]] = deque()  # followers
        self.scouts_left = {p: f for p, f in enumerate(first) if f < len(problems[p].completions)}

    def pop(self):
        return self.ready.popleft() if self.ready else super().pop()

    def finished(self, p: int, s: int) -> None:
        if self.scouts_left.get(p, 0) > 0:
            self.scouts_left[p] -= 1
            if self.scouts_left[p] == 0:
                n = len(self.problems[p].completions)
                self.ready.extend((p, s) for s in range(self.scouts, n))


def replay(problems: list[Problem], drafter, method: str, k: int, max_rows: int,
           scouts: int = 0, progress=None, on_step=None, admission=None,
           clock: VirtualClock | None = None) -> ReplayStats:
    """``on_step(stats)``, if given, is called after every verified step.
    ``admission``: the order paths enter (default: all at once, or scouts).
    ``clock``: advanced around each drafter call and by each verified step
    (the drafter must already read it)."""
    if max_rows < 1 or k < 0:
        raise ValueError("need max_rows >= 1 and k >= 0")
    batch = ReplayBatch(max_rows, max_len(problems, k))
    stats = ReplayStats(method, scouts)
    admission = admission or _Admission(problems, scouts)
    progress_of = getattr(admission, "progress", None)
    rows: list[_Row] = []
    sampled: list[list[int]] = []

    def set_row(i: int, row: _Row) -> None:
        batch.req_ids[i] = row.req_id
        batch.req_id_to_index[row.req_id] = i
        batch.num_tokens_no_spec[i] = row.n

    while True:
        while len(rows) < max_rows and (nxt := admission.pop()) is not None:
            p, s = nxt
            prob = problems[p]
            seq = prob.prompt + prob.completions[s]
            row = _Row(p, s, seq, len(prob.prompt) + 1)
            i = len(rows)
            rows.append(row)
            sampled.append([seq[row.n - 1]])
            batch.req_ids.append(row.req_id)
            batch.token_ids_cpu[i, :row.n] = seq[:row.n]
            batch.num_prompt_tokens[i] = len(prob.prompt)
            set_row(i, row)
        if stats.drain_step is None and len(rows) < max_rows:
            stats.drain_step = len(stats.step_rows)  # nothing waits: the batch drains from here
        if not rows:
            break

        if clock is not None:
            clock.begin_call()
        t0 = time.perf_counter()
        drafts = drafter(sampled, batch)
        elapsed = time.perf_counter() - t0
        if clock is not None:
            clock.end_call()
        stats.propose_s += elapsed
        stats.propose_rows += len(rows)
        stats.call_us_per_row.append(elapsed * 1e6 / len(rows))

        if any(r.done for r in rows):
            _condense(rows, sampled, drafts, batch, set_row)

        drafted, tokens_before = 0, stats.tokens
        for i, row in enumerate(rows):
            if row.done:
                continue  # aborted earlier this step
            draft = list(drafts[i])[:k]
            future = row.seq[row.n:row.n + len(draft)]
            acc = 0
            while acc < len(future) and draft[acc] == future[acc]:
                acc += 1
            new = row.seq[row.n:row.n + acc + 1]
            batch.token_ids_cpu[i, row.n:row.n + len(new)] = new
            row.n += len(new)
            batch.num_tokens_no_spec[i] = row.n
            sampled[i] = new
            stats.row_steps += 1
            stats.tokens += len(new)
            drafted += len(draft)
            stats.accepted += acc
            if row.n >= len(row.seq):
                row.done = True
                for key in admission.finished(row.problem, row.path) or ():
                    j = batch.req_id_to_index[_req_id(*key)]
                    rows[j].done = True
                    stats.aborted_tokens += rows[j].n - int(batch.num_prompt_tokens[j])
                if progress is not None:
                    progress.update(1)
        if progress_of is not None:  # the admission's vote on running paths may stop problems
            running = {(r.problem, r.path): r.n - int(batch.num_prompt_tokens[i])
                       for i, r in enumerate(rows) if not r.done}
            for key in progress_of(running) or ():
                j = batch.req_id_to_index[_req_id(*key)]
                if not rows[j].done:
                    rows[j].done = True
                    stats.aborted_tokens += rows[j].n - int(batch.num_prompt_tokens[j])
        stats.drafted += drafted
        if clock is not None:
            clock.step(len(rows), drafted)
        stats.step_rows.append(len(rows))
        stats.step_drafted.append(drafted)
        stats.step_tokens.append(stats.tokens - tokens_before)
        if on_step is not None:
            on_step(stats)
    return stats


def _condense(rows, sampled, drafts, batch, set_row) -> None:
    """Drop finished rows; fill each hole with the last live row (vLLM's condense)."""
    holes = [i for i, r in enumerate(rows) if r.done]
    for i in holes:
        del batch.req_id_to_index[rows[i].req_id]
    last = len(rows) - 1
    for hole in holes:
        while last > hole and rows[last].done:
            last -= 1
        if last <= hole:
            break
        rows[hole], sampled[hole], drafts[hole] = rows[last], sampled[last], drafts[last]
        batch.token_ids_cpu[hole, :rows[hole].n] = batch.token_ids_cpu[last, :rows[hole].n]
        batch.num_prompt_tokens[hole] = batch.num_prompt_tokens[last]
        rows[last] = _DONE
        set_row(hole, rows[hole])
        last -= 1
    live = len(rows) - len(holes)
    del rows[live:], sampled[live:], batch.req_ids[live:]
    if isinstance(drafts, list):
        del drafts[live:]


_DONE = SimpleNamespace(done=True)  # what a moved row leaves behind
