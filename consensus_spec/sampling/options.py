"""A self-consistency run's options, resolved and checked in one place: how
paths are voted (:class:`Voting`), the ``early_stop`` argument
(:func:`resolve_stop_rule`), the default schedule (:func:`resolve_schedule`)
and the checks that combine them (:func:`check_run_options`), which both
engine loops (:mod:`~consensus_spec.sampling.engine_loop`,
:mod:`~consensus_spec.sampling.async_loop`) and the server make.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..voting.answers import DEFAULT_TIMEOUT_S, extract_answer
from ..voting.confidence import DEFAULT_WINDOW
from ..voting.vote import VoteResult
from .stopping import StopRule
from .waves import ALL_AT_ONCE, Schedule

__all__ = ["Voting", "WEIGHT_METHODS", "check_run_options", "check_voting", "resolve_schedule",
           "resolve_stop_rule", "vote_is_settled"]

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


def vote_is_settled(vote: VoteResult, remaining: int, max_weight: float = 1.0) -> bool:
    """The exact rule on a finished vote: the leader's lead exceeds
    ``remaining * max_weight``, so no outcome of the remaining paths can
    change the winner.  Kept as the reference for ``StopRule(kind="decided")``
    (tests/test_stopping.py cross-checks the two); the engine loop uses
    :func:`consensus_spec.sampling.stopping.should_stop`."""
    return vote.winner is not None and vote.margin > remaining * max_weight


def check_voting(stop_rule: StopRule | None, voting: Voting) -> None:
    """A weighted vote takes no stop rule (ValueError): stop rules count
    unweighted votes.  The library's loops and the server both ask here."""
    if stop_rule is not None and voting.weighted:
        raise ValueError("stop rules count unweighted votes: weighted voting needs early_stop off")


def check_run_options(schedule: Schedule | None, stop_rule: StopRule | None,
                      voting: Voting | None, delta: bool) -> tuple[Schedule, Voting]:
    """Defaults and the checks both engine loops make (``delta``: the paths
    stream DELTA outputs)."""
    voting = voting or Voting()
    schedule = resolve_schedule(schedule, stop_rule)
    check_voting(stop_rule, voting)
    if stop_rule is not None and stop_rule.forecast and schedule.check == "wave":
        raise ValueError("StopRule(forecast=True) votes on running paths: it needs "
                         "Schedule(check='index' or 'path'), not 'wave'")
    if stop_rule is not None and stop_rule.forecast and not delta:
        raise ValueError("StopRule(forecast=True) reads running paths' text: it needs DELTA outputs")
    return schedule, voting
