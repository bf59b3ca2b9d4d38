"""The engine loop of self-consistency: run every problem's paths through an
engine in waves, vote, stop problems early.

:func:`run_paths` drives any engine with vLLM's ``LLMEngine`` request API
(``add_request``/``step``/``abort_request``) through a
:class:`~consensus_spec.sampling.path_book.PathBook` (the run's planner,
votes and stops), taking votes with :class:`Voting` options and stopping
with a :class:`~consensus_spec.sampling.stopping.StopRule`.  The
spec-decode counter helpers read vLLM's Prometheus metrics.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..voting.answers import DEFAULT_TIMEOUT_S, extract_answer
from ..voting.confidence import DEFAULT_WINDOW
from .answer_prior import AnswerPrior
from .forecast import ForecastModel
from .path_book import FORECAST_STRIDE, PathBook, _tokens_saved  # noqa: F401  (re-exported)
from .results import SelfConsistencyRun, SpecDecodeStats
from .routing import request_pinning
from .stopping import StopRule
from ..voting.vote import VoteResult
from .waves import ALL_AT_ONCE, Schedule

__all__ = [
    "PathBook",
    "Voting",
    "check_run_options",
    "read_spec_counters",
    "resolve_schedule",
    "resolve_stop_rule",
    "run_paths",
    "should_stop",
    "spec_stats_delta",
]

WEIGHT_METHODS = ("exp_mean", "softmax", "confidence")


@dataclass(frozen=True)
class Voting:
    """How a problem's finished paths are voted into one answer.

    ``extract``: text -> answer (None: no answer, the path abstains).
    ``weighted``: weight votes by :func:`~consensus_spec.voting.vote.logprob_weights`
    of mean token logprobs (``weight_method`` ``exp_mean`` or ``softmax``), or
    DeepConf-style (``"confidence"``: only the ``confidence_keep`` share of
    paths with the highest lowest-window confidence vote, weighted by it;
    :func:`~consensus_spec.voting.confidence.confidence_weights`); needs logprobs.
    ``timeout_s``: per math-verify comparison when clustering answers.
    """

    weighted: bool = False
    weight_method: str = "exp_mean"
    confidence_keep: float = 0.9  # "confidence": DeepConf's top share (its paper: 0.1 or 0.9)
    confidence_window: int = DEFAULT_WINDOW  # "confidence": tokens per window
    timeout_s: float = DEFAULT_TIMEOUT_S
    extract: Callable[[str], str | None] = extract_answer

    def __post_init__(self) -> None:
        if self.weight_method not in WEIGHT_METHODS:
            raise ValueError(f"Voting.weight_method must be one of {WEIGHT_METHODS}, "
                             f"got {self.weight_method!r}")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool) \
                or not self.timeout_s > 0:
            raise ValueError(f"Voting.timeout_s must be > 0, got {self.timeout_s!r}")
        if not callable(self.extract):
            raise ValueError("Voting.extract must be callable")
        keep, window = self.confidence_keep, self.confidence_window
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0.0 < keep <= 1.0:
            raise ValueError(f"Voting.confidence_keep must be a share in (0, 1], got {keep!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"Voting.confidence_window must be an int >= 1, got {window!r}")

    @property
    def needs_token_logprobs(self) -> bool:
        """Whether the vote reads each token's logprob, not just the path's sum."""
        return self.weighted and self.weight_method == "confidence"


def resolve_stop_rule(early_stop: Any) -> StopRule | None:
    """``early_stop`` argument -> StopRule or None (off).

    None/False: off.  True: the default :class:`StopRule` (``bayes``, error
    0.002).  A StopRule: itself.  A kind name (``"decided"``, ``"predictive"``,
    ...): that kind with default parameters.  A number m > 0 (the old margin
    API): ``StopRule(kind="margin", margin=ceil(m), min_samples=1)``.
    """
    if early_stop is None or early_stop is False:
        return None
    if early_stop is True:
        return StopRule()
    if isinstance(early_stop, StopRule):
        return early_stop
    if isinstance(early_stop, str):
        return StopRule(kind=early_stop)  # validates the kind
    if isinstance(early_stop, (int, float)) and early_stop > 0 and math.isfinite(early_stop):
        return StopRule(kind="margin", margin=math.ceil(early_stop), min_samples=1)
    raise ValueError("early_stop must be None, True, a StopRule, a rule kind or a margin > 0, "
                     f"got {early_stop!r}")


def resolve_schedule(schedule: Schedule | None, stop_rule: StopRule | None) -> Schedule:
    """None -> the default waves when stopping, else all paths at once
    (without a stop rule waves only add latency)."""
    if schedule is None:
        return Schedule() if stop_rule is not None else ALL_AT_ONCE
    if not isinstance(schedule, Schedule):
        raise ValueError(f"schedule must be a Schedule, got {schedule!r}")
    return schedule


def should_stop(vote: VoteResult, remaining: int, max_weight: float = 1.0) -> bool:
    """The exact rule on a finished vote: the leader's lead exceeds
    ``remaining * max_weight``, so no outcome of the remaining paths can
    change the winner.  Kept as the reference for ``StopRule(kind="decided")``
    (tests/test_stopping.py cross-checks the two); the engine loop uses
    :func:`consensus_spec.sampling.stopping.should_stop`."""
    return vote.winner is not None and vote.margin > remaining * max_weight


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


def check_run_options(schedule: Schedule | None, stop_rule: StopRule | None,
                      voting: Voting | None) -> tuple[Schedule, Voting]:
    """Defaults and the one cross-option check both engine loops make."""
    voting = voting or Voting()
    schedule = resolve_schedule(schedule, stop_rule)
    if stop_rule is not None and voting.weighted:
        raise ValueError("stop rules count unweighted votes: early stop needs Voting(weighted=False)")
    if stop_rule is not None and stop_rule.forecast and schedule.check == "wave":
        raise ValueError("StopRule(forecast=True) votes on running paths: it needs "
                         "Schedule(check='index' or 'path'), not 'wave'")
    return schedule, voting


def run_paths(
    engine,
    prompts: Sequence[Any],
    make_params: Callable[[int, int], Any],
    n: int,
    *,
    schedule: Schedule | None = None,
    stop_rule: StopRule | None = None,
    voting: Voting | None = None,
    max_tokens: int = 1024,
    delta: bool = False,
    render: Callable[[Any], Any] | None = None,
    on_problem_done: Callable[[int], None] | None = None,
    prior: AnswerPrior | None = None,
    forecast_model: ForecastModel | None = None,
) -> SelfConsistencyRun:
    """Engine-level loop behind :func:`self_consistency` (vLLM-agnostic).

    ``engine`` needs ``add_request(id, prompt, params, arrival_time=)``,
    ``step()``, ``abort_request(ids)`` and ``has_unfinished_requests()``, as
    ``vllm.LLM().llm_engine`` has.  ``make_params(problem, path)`` builds the
    sampling params; ``delta`` says whether they ask for DELTA outputs (needed
    to count the tokens of aborted paths; see ``Schedule.may_abort``).
    ``schedule`` (default: see :func:`resolve_schedule`) sets waves and
    capacity; ``stop_rule`` (None: never stop early) is asked with the
    unweighted answers.  ``on_problem_done(problem)`` is called once per
    problem as soon as its vote is final; ``prior``: the stop rule's
    :class:`AnswerPrior` (see :class:`PathBook`).  With
    ``stop_rule.forecast``, every :data:`FORECAST_STRIDE` steps the running
    paths' forecasts (``forecast_model``, default the shipped one) are voted
    on too (needs DELTA outputs).  Returns the run without
    spec-decode stats (the caller reads those from vLLM).
    """
    schedule, voting = check_run_options(schedule, stop_rule, voting)
    if engine.has_unfinished_requests():
        raise RuntimeError("self_consistency needs an idle engine")
    if stop_rule is not None and stop_rule.forecast and not delta:
        raise ValueError("StopRule(forecast=True) reads running paths' text: it needs DELTA outputs")
    book = PathBook(len(prompts), n, schedule, stop_rule, voting, max_tokens, prior=prior,
                    forecast_model=forecast_model)
    planner = book.planner
    run_id = uuid.uuid4().hex[:8]
    rid = lambda p, k: f"sc{run_id}-{p}-{k}"  # noqa: E731
    ids: dict[str, tuple[int, int]] = {}
    steps = inflight_sum = 0
    pin = request_pinning(engine)  # a DP rank per prompt where the engine takes one

    def submit(paths: list[tuple[int, int]]) -> None:
        for p, k in paths:
            ids[rid(p, k)] = (p, k)
            prompt = render(prompts[p]) if render is not None else prompts[p]
            engine.add_request(rid(p, k), prompt, make_params(p, k), arrival_time=time.time(),
                               **pin(prompts[p]))

    t0 = time.perf_counter()
    try:
        submit(book.admit())
        while engine.has_unfinished_requests():
            steps += 1
            inflight_sum += planner.num_inflight
            finished = []
            for out in engine.step():  # count every token before aborting any
                key = ids.get(out.request_id)
                if key is not None and book.update(key, out.outputs[0], delta) and out.finished:
                    finished.append(key)
            for key in finished:
                if key not in book.accs:
                    continue  # aborted by an earlier finish in this step
                to_submit, to_abort = book.finish(key)
                if to_abort:
                    engine.abort_request([rid(p, k) for p, k in to_abort])
                submit(to_submit)
                if on_problem_done is not None and book.done(key[0]):
                    on_problem_done(key[0])
            if book.in_flight is not None and steps % FORECAST_STRIDE == 0:
                to_submit, to_abort = book.progress()
                if to_abort:
                    engine.abort_request([rid(p, k) for p, k in to_abort])
                submit(to_submit)
                if on_problem_done is not None:
                    for p in sorted({p for p, _ in to_abort}):
                        on_problem_done(p)
            if not engine.has_unfinished_requests():
                submit(book.admit())
    except BaseException:
        if book.accs:  # leave the engine idle for the caller
            engine.abort_request([rid(p, k) for p, k in book.accs])
        raise
    return book.run(time.perf_counter() - t0, steps, inflight_sum)
