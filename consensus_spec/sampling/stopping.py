"""Adaptive stopping rules for self-consistency voting (pure logic, no vLLM).

A problem samples up to N paths; after some have finished, :func:`should_stop`
says whether the vote is settled enough to cancel the rest.  Answers are
grouped into equivalence classes by :func:`consensus_spec.voting.vote.cluster_answers`
and the rules then work on class ids (:func:`should_stop_ids`), which is also
the fast path the replay evaluation uses (``python -m evals stop-rules``).

Rules (``StopRule.kind``); every rule also stops when the vote is *decided*:

``"decided"``
    The leader's lead exceeds the number of remaining paths, so even if all
    of them joined the runner-up the full-N majority could not change.  Exact:
    zero disagreement with the full-N vote.
``"sequential"`` (the default)
    A group-sequential permutation test with alpha spending: stop after k of
    n paths when the leader holds at least ``h_k`` of them, with the boundary
    from :func:`sequential_boundary`.  Guarantee, over the *whole sequence of
    looks*: if the paths are exchangeable (their order is uniformly random
    given the multiset of n answers, e.g. i.i.d. samples voted in an order
    that does not depend on their content), then for *every* multiset of
    answers, and whatever looks the caller takes, P(stopping early on an
    answer other than the full-N majority) <= ``error``; a tie in the full-N
    vote counts as a miss whichever way it is broken.  Frequentist and worst
    case over answer splits (the worst is a 50/50 two-answer split), so the
    realized rate on real problems is far below ``error``.
``"predictive"``
    Bayesian posterior predictive: a Dirichlet(1 + counts) posterior over the
    seen classes plus one "new answer" class (uniform prior) predicts the
    remaining paths, and the rule stops when P(some class ends level with or
    ahead of the current leader after all N paths) <= ``error`` (union bound
    over challengers; ties count as flips).  ``error`` bounds the flip
    probability *at one look* under that prior; it is not a bound over the
    sequence of looks or over a population of problems (on unseen trace sets
    0.05 gave 98% agreement with the full-N vote).
``"beta"``
    Beta(1 + a, 1 + b) posterior on the leader's share among the votes for the
    leader (a) and runner-up (b); stops when P(leader's true rate > runner-up's)
    >= 1 - ``error``.  Error target: picking the wrong *population* mode
    between the top two, at one look; it ignores N, third classes and ``remaining``.
``"window"``
    ESC (Li et al. 2024): the last ``window`` finished paths all gave the
    same answer, and that answer leads.  No stated error target (heuristic).
``"margin"``
    The leader leads by at least ``margin`` votes (the engine's old heuristic).
    No stated error target.

Statistical rules wait for ``min_samples`` votes (answers that are not None).
Votes are unweighted.  Unanswerable paths (None) count as paths seen but vote
for nothing.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from ..voting.answers import DEFAULT_TIMEOUT_S
from ..voting.vote import cluster_answers

__all__ = ["KINDS", "SPEND_EXPONENT", "StopRule", "sequential_boundary", "should_stop",
           "should_stop_ids", "tally"]

KINDS = ("decided", "sequential", "predictive", "beta", "window", "margin")
# "sequential": the error spent by the look after k of n paths is error * (k/n) ** SPEND_EXPONENT.
SPEND_EXPONENT = 0.25


@dataclass(frozen=True)
class StopRule:
    """When a problem's vote may stop early (see the module docstring for each kind).

    The default, ``sequential`` with ``error`` 0.2, makes a promise over the
    whole sequence of looks.  Guarantee: for any multiset of answers of the n
    paths, if the order in which paths reach the vote is uniformly random
    given that multiset (exchangeable paths), P(the problem stops early on an
    answer other than the full-N majority vote) <= ``error`` -- summed over
    every look, for any look schedule fixed in advance (waves of any size, or
    every path), ties in the full-N vote counted as misses; ``min_samples``
    only removes stops, so it keeps the bound.  It is a frequentist worst
    case, not an average: only a 50/50 split of two answers comes near it
    (and there the full-N answer is itself a coin flip between the two); on
    the recorded trace sets the realized disagreement is 0.0-0.15% at
    ``error`` 0.2, for 39% of the full-N tokens (waves of 2).  Assumption:
    exchangeability.  It holds for whole waves of i.i.d. samples (the default
    ``Schedule``); it fails when paths are voted in the order they finish
    while all run at once (short paths first) and for recorded orders sorted
    by likelihood, where agreement falls to 96-97% on svamp.

    The default was chosen by leave-one-set-out cross-validation in
    ``python -m evals stop-rules`` (tune on two trace sets, report on the
    third, rotate): the cheapest rule with a guarantee over looks whose
    agreement with the full-N vote is >= 99.5% (>= 99% in the worst of 20
    path orders) on the tuning sets; every fold picked error 0.2.  See
    docs/stopping.md.
    """

    kind: str = "sequential"
    error: float = 0.2  # "sequential"/"predictive"/"beta": tolerated probability of being wrong
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
    With nothing remaining there is nothing to stop: returns False.  Pure:
    the result depends on the arguments only.  Raises ValueError for a
    ``remaining`` that is not an int >= 0 and TypeError for answers that are
    not a sequence of str/None.
    """
    rule = rule or StopRule()
    if not isinstance(rule, StopRule):
        raise TypeError(f"rule must be a StopRule or None, got {type(rule).__name__}")
    if overrides:
        rule = rule.with_overrides(**overrides)
    remaining = _check_remaining(remaining)
    if isinstance(answers, (str, bytes)) or not isinstance(answers, Sequence):
        raise TypeError("answers must be a sequence of answers (str or None), "
                        f"got {type(answers).__name__}")
    bad = next((a for a in answers if a is not None and not isinstance(a, str)), None)
    if bad is not None:
        raise TypeError(f"answers must be str or None (None: the path has no answer), "
                        f"got {type(bad).__name__} {bad!r}")
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
    remaining = _check_remaining(remaining)
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
    if rule.kind == "sequential":
        bound = sequential_boundary(len(ids) + remaining, rule.error)[0][len(ids)]
        return bound is not None and lead >= bound
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


def _check_remaining(remaining) -> int:
    """``remaining`` as an int (numpy ints too); ValueError unless an int >= 0."""
    try:
        value = None if isinstance(remaining, bool) else operator.index(remaining)
    except TypeError:
        value = None
    if value is None or value < 0:
        raise ValueError(f"remaining must be an int >= 0, got {remaining!r}")
    return value


@lru_cache(maxsize=512)
def sequential_boundary(n: int, error: float) -> tuple[tuple[int | None, ...], float]:
    """The ``"sequential"`` rule's boundary for ``n`` paths: ``(h, bound)``.

    ``h[k]`` (k = 0..n) is the least number of votes the leader must hold
    among the first k paths to stop there (None: no stop after k paths);
    ``bound`` is the certified worst-case probability of a wrong stop.

    Construction.  Fix the multiset of the n answers and let the order be
    uniformly random.  A class with c of the n paths holds a hypergeometric
    count of the first k; a recursion over k gives, for every c, the chance
    G(c) that the class ever reaches the boundary, looking after *every*
    path (so any subset of looks, i.e. any wave schedule, is covered).  The
    boundary stays above k/2, so only the leader can reach it, and a wrong
    stop needs some class that is not the strict full-N winner to reach it:
    P(wrong stop) <= sum of G(c) over those classes.  The worst case of that
    sum over all multisets (a knapsack over class sizes, see
    :func:`_worst_case`) is kept <= ``error * (k/n) ** SPEND_EXPONENT`` after
    each look k (alpha spending), with ``h[k]`` the least count that does so.
    """
    n = operator.index(n)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0.0 < error < 1.0:
        raise ValueError(f"error must be in (0, 1), got {error!r}")
    h: list[int | None] = [None] * (n + 1)
    c = np.arange(n + 1)[:, None]
    a = np.arange(n + 1)[None, :]
    mass = np.zeros((n + 1, n + 1))  # [c, a]: P(a of the first k paths, never crossed)
    mass[:, 0] = 1.0
    crossed = np.zeros(n + 1)  # per class size c: P(crossed by look k)
    for k in range(1, n):
        moved = mass * np.clip((c - a) / (n - k + 1), 0.0, 1.0)  # path k joins the class
        mass -= moved
        mass[:, 1:] += moved[:, :-1]
        budget = error * (k / n) ** SPEND_EXPONENT
        tails = np.cumsum(mass[:, ::-1], axis=1)[:, ::-1]  # tails[c, t] = P(count >= t)
        lo, hi = k // 2 + 1, k + 1  # hi: no stop at k
        while lo < hi:  # the worst case falls as the count needed rises
            mid = (lo + hi) // 2
            if _worst_case(crossed + tails[:, mid], n) <= budget:
                hi = mid
            else:
                lo = mid + 1
        if lo <= k:
            h[k] = lo
            crossed = crossed + tails[:, lo]
            mass[:, lo:] = 0.0
    return tuple(h), _worst_case(crossed, n)


def _worst_case(value: np.ndarray, n: int) -> float:
    """max over multisets of n answers of sum(value[c_A]) over the classes A
    that are not the strict winner: either a strict winner with m votes and
    the others <= m - 1 (at most n - m votes in all, Nones fill the rest), or
    a tie at m (two classes of m, the others <= m)."""
    best = np.zeros(n + 1)  # best[C]: max sum over classes of size <= m using <= C paths
    worst = 0.0
    for m in range(1, n + 1):
        worst = max(worst, best[n - m])  # strict winner of size m
        v = value[m]
        if v > 0:  # unbounded knapsack item of size m, block by block
            for start in range(m, n + 1, m):
                end = min(start + m, n + 1)
                np.maximum(best[start:end], best[start - m:end - m] + v, out=best[start:end])
        if 2 * m <= n:
            worst = max(worst, 2 * v + best[n - 2 * m])  # tie at m
    return float(worst)


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


def lru_sizes(*functions) -> dict[str, list[int]]:
    """Name -> [entries held, bound] of memoized functions."""
    return {f.__name__: [f.cache_info().currsize, f.cache_info().maxsize] for f in functions}


def cache_sizes() -> dict[str, list[int]]:
    """The stop rules' memos (a server reports them: bounded, however long it runs)."""
    return lru_sizes(sequential_boundary, _beta_confidence, _flip_probability)


def _betabinom_pmf(k, n, a: float, b: float):
    from scipy.special import betaln, gammaln  # imported on use: keeps the package import light
    return np.exp(gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1)
                  + betaln(k + a, n - k + b) - betaln(a, b))
