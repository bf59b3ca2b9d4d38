"""Path scheduling for self-consistency: which paths run when, and when a
problem's vote may stop early.

:class:`PathPlanner` and :func:`should_stop` are pure logic and know nothing
of vLLM; :func:`run_paths` drives any engine with vLLM's ``LLMEngine``
request API (``add_request``/``step``/``abort_request``) through them.  The
spec-decode counter helpers read vLLM's Prometheus metrics.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Callable, Sequence

from .answers import DEFAULT_TIMEOUT_S, extract_answer
from .results import ProblemResult, Sample, SpecDecodeStats
from .voting import VoteResult, logprob_weights, majority_vote

__all__ = [
    "PathPlanner",
    "read_spec_counters",
    "run_paths",
    "should_stop",
    "spec_stats_delta",
]


# ---------------------------------------------------------------------------
# Pure logic: stop rule and path planning
# ---------------------------------------------------------------------------


def should_stop(
    vote: VoteResult, remaining: int, margin: float | None = None, max_weight: float = 1.0
) -> bool:
    """Whether a problem's vote can stop before its ``remaining`` paths finish.

    Stops when the leader's lead exceeds ``remaining * max_weight`` (even if
    every remaining path joined the runner-up it could not draw level, so the
    full-N winner is already known), or, if ``margin`` is given, when the
    lead is at least ``margin`` (a heuristic that trades accuracy for tokens).
    """
    if vote.winner is None:
        return False
    lead = vote.margin
    if lead > remaining * max_weight:
        return True
    return margin is not None and lead >= margin


class PathPlanner:
    """Which (problem, path) requests to submit or abort, event by event.

    New problems are admitted in order while fewer than ``capacity`` paths are
    in flight, so the engine batch stays full without queueing every problem
    up front.  With ``scouts = S`` a problem first gets paths 0..S-1; paths
    S..N-1 are submitted as soon as its scouts finish (ahead of problems not
    yet admitted).  ``stop_check(problem, answers_by_path, remaining)``
    decides early stop.
    """

    def __init__(
        self,
        num_problems: int,
        n: int,
        scouts: int = 0,
        capacity: int | None = None,
        stop_check: Callable[[int, dict[int, Any], int], bool] | None = None,
    ):
        if n < 1:
            raise ValueError("n must be >= 1")
        if not 0 <= scouts <= n:
            raise ValueError("scouts must be in [0, n]")
        self.num_problems, self.n = num_problems, n
        self.scouts = scouts if 0 < scouts < n else 0
        self.capacity = capacity if capacity and capacity > 0 else None
        self.stop_check = stop_check
        self.next_problem = 0
        self.inflight: dict[int, set[int]] = {}  # problem -> running paths
        self.finished: dict[int, dict[int, Any]] = {}  # problem -> path -> answer
        self.unsubmitted: dict[int, list[int]] = {}  # follow-up paths not yet sent
        self.stopped: set[int] = set()
        self.num_inflight = 0

    def admit(self) -> list[tuple[int, int]]:
        """Admit waiting problems while there is room; return paths to submit."""
        out: list[tuple[int, int]] = []
        while self.next_problem < self.num_problems and (
            self.capacity is None or self.num_inflight < self.capacity
        ):
            p = self.next_problem
            self.next_problem += 1
            first = self.scouts or self.n
            self.finished[p] = {}
            self.unsubmitted[p] = list(range(first, self.n))
            out += self._submit(p, list(range(first)))
        return out

    def on_finish(self, p: int, path: int, answer: Any) -> tuple[list, list]:
        """Record a finished path; return (paths to submit, paths to abort)."""
        if path not in self.inflight.get(p, ()):
            return [], []  # already aborted
        self.inflight[p].discard(path)
        self.num_inflight -= 1
        self.finished[p][path] = answer
        submit: list[tuple[int, int]] = []
        abort: list[tuple[int, int]] = []
        remaining = self.n - len(self.finished[p])
        if remaining and self.stop_check and self.stop_check(p, self.finished[p], remaining):
            abort = [(p, k) for k in sorted(self.inflight[p])]
            self.num_inflight -= len(abort)
            self.inflight[p].clear()
            self.unsubmitted[p] = []
            self.stopped.add(p)
        elif self.unsubmitted[p] and not self.inflight[p]:
            submit = self._submit(p, self.unsubmitted[p])  # scouts done
            self.unsubmitted[p] = []
        return submit + self.admit(), abort

    def done(self, p: int) -> bool:
        return p in self.stopped or len(self.finished.get(p, ())) == self.n

    @property
    def all_done(self) -> bool:
        return self.next_problem == self.num_problems and all(
            self.done(p) for p in range(self.num_problems)
        )

    def _submit(self, p: int, paths: list[int]) -> list[tuple[int, int]]:
        self.inflight.setdefault(p, set()).update(paths)
        self.num_inflight += len(paths)
        return [(p, k) for k in paths]


def _tokens_saved(finished_lengths: list[int], cancelled_progress: list[int], max_tokens: int) -> int:
    """Estimate of tokens not generated thanks to early stop: each cancelled
    path is assumed to have needed the problem's mean finished length
    (``max_tokens`` if none finished), minus what it had already produced."""
    expected = sum(finished_lengths) / len(finished_lengths) if finished_lengths else max_tokens
    return int(round(sum(max(0.0, expected - done) for done in cancelled_progress)))


def _stop_rule(early_stop, weighted: bool, weight_method: str):
    """(margin, max weight per vote) for the early-stop rule, or None if off."""
    if early_stop is None or early_stop is False:
        return None
    if weighted and weight_method != "exp_mean":
        raise ValueError("early_stop needs per-vote weights bounded by 1 (weight_method='exp_mean')")
    if early_stop is True or early_stop == "decided":
        return (None, 1.0)
    if isinstance(early_stop, (int, float)) and early_stop > 0:
        return (float(early_stop), 1.0)
    raise ValueError(f"early_stop must be None, True, 'decided' or a margin > 0, got {early_stop!r}")


# ---------------------------------------------------------------------------
# vLLM plumbing: spec-decode counters and the engine step loop
# ---------------------------------------------------------------------------

_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


def read_spec_counters(llm) -> dict[str, int] | None:
    """Current spec-decode counter totals, or None if vLLM does not expose them
    (stat logging disabled, or no speculative decoding configured)."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # AssertionError("Stat logging disabled") and API drift
        return None
    totals: dict[str, int] = {}
    for m in metrics:
        key = _SPEC_COUNTERS.get(getattr(m, "name", None))
        if key is not None and hasattr(m, "value"):  # sum across engines/labels
            totals[key] = totals.get(key, 0) + int(m.value)
    return totals if len(totals) == len(_SPEC_COUNTERS) else None


def spec_stats_delta(before: dict[str, int] | None, after: dict[str, int] | None) -> SpecDecodeStats | None:
    if before is None or after is None:
        return None
    return SpecDecodeStats(**{k: after[k] - before.get(k, 0) for k in after})


class _Accumulator:
    """Collects one request's output; handles DELTA and FINAL_ONLY outputs."""

    __slots__ = ("texts", "num_tokens", "cumulative_logprob", "finish_reason")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.num_tokens = 0
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None

    def update(self, completion, delta: bool) -> None:
        if delta:
            self.texts.append(completion.text)
            self.num_tokens += len(completion.token_ids)
        else:
            self.texts = [completion.text]
            self.num_tokens = len(completion.token_ids)
        self.cumulative_logprob = completion.cumulative_logprob  # running total
        self.finish_reason = completion.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.texts)


def run_paths(
    engine,
    prompts: Sequence[Any],
    make_params: Callable[[int, int], Any],
    n: int,
    scouts: int = 0,
    capacity: int | None = None,
    early_stop: bool | float | str | None = None,
    weighted: bool = False,
    weight_method: str = "exp_mean",
    max_tokens: int = 1024,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    extract: Callable[[str], str | None] = extract_answer,
    delta: bool = False,
    render: Callable[[Any], Any] | None = None,
    on_problem_done: Callable[[int], None] | None = None,
) -> list[ProblemResult]:
    """Engine-level loop behind :func:`self_consistency` (vLLM-agnostic).

    ``engine`` needs ``add_request(id, prompt, params, arrival_time=)``,
    ``step()``, ``abort_request(ids)`` and ``has_unfinished_requests()``, as
    ``vllm.LLM().llm_engine`` has.  ``make_params(problem, path)`` builds the
    sampling params; ``delta`` says whether they ask for DELTA outputs.
    ``on_problem_done(problem)`` is called once per problem as soon as all
    its paths have finished or it stopped early (e.g. to drive a progress bar).
    """
    stop_rule = _stop_rule(early_stop, weighted, weight_method)
    if engine.has_unfinished_requests():
        raise RuntimeError("self_consistency needs an idle engine")
    num = len(prompts)
    samples: dict[int, dict[int, Sample]] = {i: {} for i in range(num)}

    def vote_of(p: int) -> tuple[VoteResult, list[float] | None]:
        done = [samples[p][k] for k in sorted(samples[p])]
        weights = None
        if weighted:  # a zero-token path has no mean logprob: weight 0
            lps = [-math.inf if s.mean_logprob is None else s.mean_logprob for s in done]
            weights = logprob_weights(lps, weight_method)
        return majority_vote([s.answer for s in done], weights, timeout_s), weights

    def stop_check(p: int, _answers: dict, remaining: int) -> bool:
        margin, max_w = stop_rule
        return should_stop(vote_of(p)[0], remaining, margin, max_w)

    planner = PathPlanner(num, n, scouts, capacity, stop_check if stop_rule else None)
    run_id = uuid.uuid4().hex[:8]
    rid = lambda p, k: f"sc{run_id}-{p}-{k}"  # noqa: E731
    ids: dict[str, tuple[int, int]] = {}
    accs: dict[tuple[int, int], _Accumulator] = {}  # running paths
    cancelled: dict[int, list[int]] = {i: [] for i in range(num)}  # tokens done per cancelled path

    def submit(paths: list[tuple[int, int]]) -> None:
        for p, k in paths:
            ids[rid(p, k)] = (p, k)
            accs[(p, k)] = _Accumulator()
            prompt = render(prompts[p]) if render is not None else prompts[p]
            engine.add_request(rid(p, k), prompt, make_params(p, k), arrival_time=time.time())

    def abort(paths: list[tuple[int, int]]) -> None:
        if not paths:
            return
        engine.abort_request([rid(p, k) for p, k in paths])
        for p, k in paths:
            cancelled[p].append(accs.pop((p, k)).num_tokens)

    def stopped(p: int) -> None:  # unsubmitted paths count as cancelled at 0 tokens
        cancelled[p] += [0] * (n - len(samples[p]) - len(cancelled[p]))

    try:
        submit(planner.admit())
        while engine.has_unfinished_requests():
            finished = []
            for out in engine.step():  # count every token before aborting any
                key = ids.get(out.request_id)
                if key is None or key not in accs:
                    continue  # not ours, or already aborted
                accs[key].update(out.outputs[0], delta)
                if out.finished:
                    finished.append(key)
            for key in finished:
                if key not in accs:
                    continue  # aborted by an earlier finish in this step
                p, k = key
                acc = accs.pop(key)
                samples[p][k] = Sample(k, acc.text, extract(acc.text), acc.num_tokens,
                                       acc.cumulative_logprob, acc.finish_reason)
                to_submit, to_abort = planner.on_finish(p, k, samples[p][k].answer)
                abort(to_abort)
                if p in planner.stopped:
                    stopped(p)
                submit(to_submit)
                if on_problem_done is not None and planner.done(p):
                    on_problem_done(p)
            if not engine.has_unfinished_requests():
                submit(planner.admit())
    except BaseException:
        if accs:  # leave the engine idle for the caller
            engine.abort_request([rid(p, k) for p, k in accs])
        raise

    results = []
    for p in range(num):
        vote, weights = vote_of(p)
        done = [samples[p][k] for k in sorted(samples[p])]
        results.append(ProblemResult(
            index=p,
            vote=vote,
            samples=done,
            num_aborted=len(cancelled[p]),
            aborted_tokens=sum(cancelled[p]),
            est_tokens_saved=_tokens_saved([s.num_tokens for s in done], cancelled[p], max_tokens),
            stopped_early=p in planner.stopped,
            weights=weights,
        ))
    return results
