"""Adaptive stopping rules for self-consistency voting (pure logic, no vLLM).

A problem samples up to N paths; after some have finished, :func:`should_stop`
says whether the vote is settled enough to cancel the rest.  Answers are
grouped into equivalence classes by :func:`consensus_spec.voting.vote.cluster_answers`
and the rules then work on class ids (:func:`should_stop_ids`), which is also
the fast path the replay evaluation uses (``python -m evals stopping``).

Rules (``StopRule.kind``); every rule also stops when the vote is *decided*:

``"decided"``
    The leader's lead exceeds the number of remaining paths, so even if all
    of them joined the runner-up the full-N majority could not change.  Exact:
    zero disagreement with the full-N vote.
``"predictive"``
    Bayesian posterior predictive: a Dirichlet(1 + counts) posterior over the
    seen classes plus one "new answer" class (uniform prior) predicts the
    remaining paths, and the rule stops when P(some class ends level with or
    ahead of the current leader after all N paths) <= ``error`` (union bound
    over challengers; ties count as flips).  Error target: disagreement with
    the *full-N majority*, which is what stopping early gives up.  It uses
    ``remaining``, so with few paths left it stops sooner.
``"beta"``
    Beta(1 + a, 1 + b) posterior on the leader's share among the votes for the
    leader (a) and runner-up (b); stops when P(leader's true rate > runner-up's)
    >= 1 - ``error``.  Error target: picking the wrong *population* mode
    between the top two; it ignores N, third classes and ``remaining``.
``"window"``
    ESC (Li et al. 2024): the last ``window`` finished paths all gave the
    same answer, and that answer leads.  No stated error target (heuristic).
``"margin"``
    The leader leads by at least ``margin`` votes (the engine's old heuristic).
    No stated error target.

Statistical rules wait for ``min_samples`` votes (answers that are not None).
Votes are unweighted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from ..voting.answers import DEFAULT_TIMEOUT_S
from ..voting.vote import cluster_answers

__all__ = ["KINDS", "StopRule", "should_stop", "should_stop_ids", "tally"]

KINDS = ("decided", "predictive", "beta", "window", "margin")


@dataclass(frozen=True)
class StopRule:
    """When a problem's vote may stop early.

    The default (predictive, error 0.05) is what ``python -m evals stopping``
    picks on the recorded traces: the fewest tokens with >= 99% agreement with
    the full-N vote on every set and order, and ~97% on hard problems.
    """

    kind: str = "predictive"
    error: float = 0.05  # "predictive"/"beta": tolerated probability of being wrong
    min_samples: int = 3  # votes needed before a statistical rule may stop
    window: int = 4  # "window": identical answers in a row
    margin: int = 3  # "margin": lead in votes

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"StopRule.kind must be one of {KINDS}, got {self.kind!r}")
        if isinstance(self.error, bool) or not isinstance(self.error, (int, float)) \
                or not 0.0 < self.error < 1.0:
            raise ValueError(f"StopRule.error must be a probability in (0, 1), got {self.error!r}")
        for name, low in (("min_samples", 1), ("window", 2), ("margin", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"StopRule.{name} must be an int >= {low}, got {value!r}")

    def describe(self) -> str:
        """One line for tables, e.g. ``predictive(error=0.05, min=3)``."""
        if self.kind == "decided":
            return "decided"
        if self.kind == "window":
            return f"window({self.window})"
        detail = f"margin={self.margin}" if self.kind == "margin" else f"error={self.error:g}"
        return f"{self.kind}({detail}, min={self.min_samples})"

    def with_overrides(self, **overrides) -> "StopRule":
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown StopRule field(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **overrides)


def should_stop(
    answers: Sequence[str | None], remaining: int, rule: StopRule | None = None, *,
    timeout_s: float = DEFAULT_TIMEOUT_S, **overrides
) -> bool:
    """Whether a problem may stop with ``remaining`` paths unfinished.

    ``answers``: extracted answers of the finished paths in finishing order
    (None: no answer).  ``remaining``: paths not finished yet, including ones
    not started.  ``overrides`` replace fields of ``rule`` (default
    :class:`StopRule`), e.g. ``should_stop(a, 5, kind="window", window=5)``.
    ``timeout_s``: per math-verify comparison when clustering the answers.
    With nothing remaining there is nothing to stop: returns False.
    """
    rule = rule or StopRule()
    if overrides:
        rule = rule.with_overrides(**overrides)
    _check_remaining(remaining)
    if remaining == 0 or all(a is None for a in answers):
        return False  # skip clustering (and math-verify) when it cannot matter
    return should_stop_ids(cluster_answers(list(answers), timeout_s), remaining, rule)


def should_stop_ids(
    ids: Sequence[int | None],
    remaining: int,
    rule: StopRule | None = None,
    *,
    ranked: Sequence[tuple[int, int]] | None = None,
) -> bool:
    """:func:`should_stop` on precomputed class ids (None: no answer).

    ``ranked`` may pass ``tally(ids)`` when the caller keeps it up to date
    incrementally (the replay evaluation does, over millions of checks).
    """
    rule = rule or StopRule()
    _check_remaining(remaining)
    if ranked is None:
        ranked = tally(ids)
    if remaining == 0 or not ranked:
        return False
    lead_id, lead = ranked[0]
    second = ranked[1][1] if len(ranked) > 1 else 0
    if lead - second > remaining:
        return True  # decided: exact
    votes = sum(c for _, c in ranked)
    if rule.kind == "decided" or votes < rule.min_samples:
        return False
    if rule.kind == "margin":
        return lead - second >= rule.margin
    if rule.kind == "beta":
        return _beta_confidence(lead, second) >= 1.0 - rule.error
    if rule.kind == "window":
        tail = list(ids[-rule.window:])
        return len(tail) == rule.window and all(i == lead_id for i in tail)
    # predictive
    counts = tuple(c for _, c in ranked)
    return _flip_probability(counts, len(ids) - votes, remaining) <= rule.error


def tally(ids: Sequence[int | None]) -> list[tuple[int, int]]:
    """(class id, votes) ranked like :func:`~consensus_spec.voting.vote.majority_vote`:
    most votes first, ties to the class that appeared first."""
    counts: dict[int, int] = {}
    for i in ids:
        if i is not None:
            counts[i] = counts.get(i, 0) + 1  # dicts keep first-appearance order
    return sorted(counts.items(), key=lambda kv: -kv[1])  # stable sort keeps ties in order


def _check_remaining(remaining: int) -> None:
    if isinstance(remaining, bool) or not isinstance(remaining, int) or remaining < 0:
        raise ValueError(f"remaining must be an int >= 0, got {remaining!r}")


@lru_cache(maxsize=4096)
def _beta_confidence(a: int, b: int) -> float:
    """P(p > 1/2) for p ~ Beta(1 + a, 1 + b)."""
    from scipy.special import betainc  # imported on use: keeps the package import light
    return float(betainc(1 + b, 1 + a, 0.5))  # I_{1/2}(1+b, 1+a) = P(p > 1/2) by symmetry


@lru_cache(maxsize=1 << 17)
def _flip_probability(counts: tuple[int, ...], abstained: int, remaining: int) -> float:
    """Upper bound on P(the leader is not the unique full-N winner) under the
    Dirichlet-multinomial posterior predictive; ``counts`` ranked, leader first."""
    lead = counts[0]
    # Dirichlet parameters: 1 + count per seen class, 1 for an unseen class,
    # and the abstentions so far (no prior) for future Nones.
    alphas = [c + 1.0 for c in counts] + [1.0]
    total_alpha = sum(alphas) + abstained
    challengers = list(zip(list(counts[1:]) + [0], alphas[1:]))
    flip = 0.0
    for count, alpha in challengers:
        if count + remaining < lead:
            continue  # cannot catch up even with every remaining path
        a_lead, rest = alphas[0], total_alpha - alphas[0] - alpha
        # M of the remaining paths go to leader or challenger, X of those to the
        # challenger; the challenger draws level or better when 2X >= lead gap + M.
        m = np.arange(remaining + 1)[:, None]
        x = np.arange(remaining + 1)[None, :]
        if rest == 0:
            p_m = (m[:, 0] == remaining).astype(float)
        else:
            p_m = _betabinom_pmf(m[:, 0], remaining, a_lead + alpha, rest)
        hit = (x <= m) & (2 * x >= lead - count + m)
        p_x = _betabinom_pmf(np.minimum(x, m), m, alpha, a_lead)  # n=m broadcasts
        flip += float(p_m @ np.where(hit, p_x, 0.0).sum(axis=1))
        if flip >= 1.0:
            return 1.0
    return flip


def _betabinom_pmf(k, n, a: float, b: float):
    from scipy.special import betaln, gammaln  # imported on use: keeps the package import light
    return np.exp(gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1)
                  + betaln(k + a, n - k + b) - betaln(a, b))
