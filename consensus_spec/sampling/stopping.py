"""Adaptive stopping rules for self-consistency voting (pure logic, no vLLM).

A problem samples up to N paths; after some have finished, :func:`should_stop`
says whether the vote is settled enough to cancel the rest.  Answers are
grouped into equivalence classes by :func:`consensus_spec.voting.vote.cluster_answers`
and the rules then work on class ids (:func:`should_stop_ids`), which is also
the fast path the replay evaluation uses (``python -m evals stop-rules``).

Rules (``StopRule.kind``); every rule of ours also stops when the vote is
*decided* (the peers' kinds, last, do exactly what their authors' code does):

``"bayes"`` (the default)
    Empirical Bayes: stop when the posterior chance that the vote still
    flips is <= ``error``.  The posterior is over the shares of the
    problem's two most common answers, under a prior that the run learns
    from its own finished problems (:class:`~consensus_spec.sampling.answer_prior.AnswerPrior`,
    passed as ``prior``; without one, the shipped prior fitted on recorded
    traces).  A flip is the runner-up, or an answer not seen yet, ending
    strictly ahead of the leader after all N paths (a tie does not count).
    The chance is exact under the model and the prior; it is not a
    frequentist bound: a prior far from the run's problems (before the run
    has learned) misstates it.  Default ``error`` chosen by leave-one-set-out
    cross-validation (``python -m evals stop-rules``, docs/stopping.md).
``"decided"``
    The leader's lead exceeds the number of remaining paths, so even if all
    of them joined the runner-up the full-N majority could not change.  Exact:
    zero disagreement with the full-N vote.
``"sequential"``
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
    Bayesian posterior predictive under a uniform Dirichlet prior over the
    seen classes plus one "new answer" class; stops when P(some class ends
    level with or ahead of the leader) <= ``error`` (union bound over
    challengers; ties count as flips), at one look.
``"beta"``
    Beta(1 + a, 1 + b) posterior on the leader's share among the votes for the
    leader (a) and runner-up (b); stops when P(leader's true rate > runner-up's)
    >= 1 - ``error``.  At one look; it ignores N, third classes and ``remaining``.
``"window"``
    The last ``window`` finished paths all gave the leading answer (sliding).
``"margin"``
    The leader leads by at least ``margin`` votes.

The peers, as their authors' code has them (answers that are None vote for
nothing; their code would count an unparsed answer as one more answer):

``"adaptive"``
    Adaptive-Consistency (Aggarwal et al. 2023, ``BetaStoppingCriteria``):
    P(p > 1/2) >= 1 - ``error`` for p ~ Beta(a + 1, b + 1), a and b the top
    two answers' votes; a look after every path, no other stop (published:
    ``error`` 0.05).
``"esc"``
    Early-Stopping Self-Consistency (Li et al. 2024): windows of ``window``
    paths that do not overlap (published: 5); stop after a window whose
    answers are all the same, and answer with it.
``"consol"``
    ConSol (arXiv 2503.17587, 2025; ``SprtConfidenceModel``): Wald's SPRT of the top
    two answers' votes, p0 = 0.5 against p1 = 0.5001, alpha = 0.05, beta =
    1 - 0.05 - 0.000024 as published (it stops at a lead of 3).

Statistical rules wait for ``min_samples`` votes (answers that are not None).
Votes are unweighted.  Unanswerable paths (None) count as paths seen but vote
for nothing.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from ..voting.answers import DEFAULT_TIMEOUT_S
from ..voting.vote import cluster_answers
from .answer_prior import AnswerPrior, overtake

__all__ = ["KINDS", "MAIN_FIELD", "PEERS", "SPEND_EXPONENT", "AnswerPrior", "StopRule", "sequential_boundary",
           "should_stop", "should_stop_ids", "stop_answer", "tally"]

KINDS = ("bayes", "decided", "sequential", "predictive", "beta", "window", "margin",
         "adaptive", "esc", "consol")
PEERS = ("adaptive", "esc", "consol")  # as published: no decided stop, no min_samples
# per kind: the default error (kinds with a stated error), min_samples and window
DEFAULT_ERROR = {"bayes": 0.002, "sequential": 0.2, "predictive": 0.05, "beta": 0.05,
                 "adaptive": 0.05}
DEFAULT_MIN_SAMPLES = {"bayes": 1}  # other kinds of ours: 3
DEFAULT_WINDOW = {"esc": 5}  # "window": 4
# per kind: the field its one parameter sets (the text form KIND:VALUE, e.g. "bayes:0.01")
MAIN_FIELD = {**{kind: "error" for kind in DEFAULT_ERROR}, "window": "window", "esc": "window",
              "margin": "margin"}
# "sequential": the error spent by the look after k of n paths is error * (k/n) ** SPEND_EXPONENT.
SPEND_EXPONENT = 0.25
# "consol": ConSol's SprtConfidenceModel as published (p0 = 0.5)
CONSOL_P1, CONSOL_ALPHA, CONSOL_BETA = 0.5001, 0.05, 1 - 0.05 - 0.000024


@dataclass(frozen=True)
class StopRule:
    """When a problem's vote may stop early (see the module docstring for each kind).

    The default, ``bayes``: stop once the posterior chance that the rest of
    the paths flip the vote is <= ``error`` (0.002), under a prior over how
    problems split their answers that a run learns from its own finished
    problems (:class:`~consensus_spec.sampling.answer_prior.AnswerPrior`).
    Chosen by leave-one-set-out cross-validation in ``python -m evals
    stop-rules`` (tune on two recorded trace sets, report on the third) as
    the cheapest rule that agrees with the full-N vote in >= 99.5% of
    problems (>= 99% in the worst of 20 path orders) on the tuning sets; see
    docs/stopping.md.  It promises nothing for a problem unlike the prior;
    ``sequential`` does (a bound over every look, for every problem, when
    paths are exchangeable), at more tokens.

    ``error``, ``min_samples`` and ``window`` left None take the kind's
    default (:data:`DEFAULT_ERROR`, 3 votes but for ``bayes``, 4 paths but
    for ``esc``); kinds without them keep None.
    """

    kind: str = "bayes"
    error: float | None = None  # tolerated probability of being wrong (kinds in DEFAULT_ERROR)
    min_samples: int | None = None  # votes needed before a statistical rule may stop
    window: int | None = None  # "window": identical answers in a row; "esc": window size
    margin: int = 3  # "margin": lead in votes

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"StopRule.kind must be one of {KINDS}, got {self.kind!r}")
        defaults = {"error": DEFAULT_ERROR.get(self.kind),
                    "min_samples": DEFAULT_MIN_SAMPLES.get(self.kind, 3),
                    "window": DEFAULT_WINDOW.get(self.kind, 4)}
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.error is not None:
            e = self.error
            if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0.0 < e < 1.0:
                raise ValueError(f"StopRule.error must be a probability in (0, 1), got {e!r}")
        for name, low in (("min_samples", 1), ("window", 2), ("margin", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"StopRule.{name} must be an int >= {low}, got {value!r}")

    def describe(self) -> str:
        """One line for tables, e.g. ``bayes(error=0.002)``."""
        if self.kind in ("decided", "consol"):
            return self.kind
        if self.kind in ("window", "esc"):
            return f"{self.kind}({self.window})"
        if self.kind == "margin":
            return f"margin(margin={self.margin}, min={self.min_samples})"
        if self.kind in ("bayes", "adaptive"):
            return f"{self.kind}(error={self.error:g})"
        return f"{self.kind}(error={self.error:g}, min={self.min_samples})"

    def with_overrides(self, **overrides) -> "StopRule":
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown StopRule field(s): {', '.join(sorted(unknown))}")
        if "kind" in overrides:  # the other kind's own defaults, where not given
            keep = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                    if f.name not in ("kind", "error", "min_samples", "window")}
            return StopRule(**{**keep, **overrides})
        return dataclasses.replace(self, **overrides)


def should_stop(
    answers: Sequence[str | None], remaining: int, rule: StopRule | None = None, *,
    prior: AnswerPrior | None = None, lengths: Sequence[int] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S, **overrides
) -> bool:
    """Whether a problem may stop with ``remaining`` paths unfinished.

    ``answers``: extracted answers of the finished paths, in path order
    (None: no answer).  ``remaining``: paths not finished yet, including ones
    not started.  ``overrides`` replace fields of ``rule`` (default
    :class:`StopRule`), e.g. ``should_stop(a, 5, kind="esc")``.  ``prior``
    (``bayes`` only): the run's :class:`AnswerPrior` (default: the shipped
    one, which learns nothing); give one prior to every problem of a run and
    ``prior.observe(...)`` each finished problem's vote.  ``lengths``: the
    finished paths' lengths in tokens (optional): long paths mark hard
    problems, which a learning prior weighs once its run has taught it how.
    ``timeout_s``: per math-verify comparison when clustering the answers.
    With nothing remaining there is nothing to stop: returns False.  Raises
    ValueError for a ``remaining`` that is not an int >= 0 and TypeError for
    answers that are not a sequence of str/None.
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
    if remaining == 0 or (rule.kind != "esc" and all(a is None for a in answers)):
        return False  # skip clustering (and math-verify) when it cannot matter
    length = None
    if lengths is not None:
        if len(lengths) != len(answers) or any(isinstance(x, bool) or not isinstance(x, (int, float))
                                               or x < 0 for x in lengths):
            raise ValueError("lengths must give one number >= 0 per answer")
        length = sum(lengths) / len(lengths) if lengths else None
    return should_stop_ids(cluster_answers(list(answers), timeout_s), remaining, rule, prior=prior,
                           length=length)


def should_stop_ids(
    ids: Sequence[int | None],
    remaining: int,
    rule: StopRule | None = None,
    *,
    ranked: Sequence[tuple[int, int]] | None = None,
    prior: AnswerPrior | None = None,
    length: float | None = None,
) -> bool:
    """:func:`should_stop` on precomputed class ids (None: no answer);
    ``length``: the mean of ``lengths``.

    ``ranked`` may pass ``tally(ids)`` when the caller keeps it up to date
    incrementally (the replay evaluation does, over millions of checks).
    """
    rule = rule or StopRule()
    remaining = _check_remaining(remaining)
    if remaining == 0:
        return False
    if rule.kind == "esc":  # a whole window of one answer (None too, as ESC's invalid answer)
        k = len(ids)
        return k % rule.window == 0 and k > 0 and len(set(ids[k - rule.window:])) == 1
    if ranked is None:
        ranked = tally(ids)
    if not ranked:
        return False
    lead = ranked[0][1]
    second = ranked[1][1] if len(ranked) > 1 else 0
    if rule.kind == "adaptive":
        return _beta_confidence(lead, second) >= 1.0 - rule.error
    if rule.kind == "consol":
        llr = lead * math.log(CONSOL_P1 / 0.5) + second * math.log((1 - CONSOL_P1) / 0.5)
        return llr >= math.log((1 - CONSOL_BETA) / CONSOL_ALPHA) \
            or llr <= math.log(CONSOL_BETA / (1 - CONSOL_ALPHA))
    if lead - second > remaining:
        return True  # decided: exact
    votes = sum(c for _, c in ranked)
    if rule.kind == "decided" or votes < rule.min_samples:
        return False
    if rule.kind == "bayes":
        prior = prior or AnswerPrior.default()
        flip = prior.flip_probability(lead, second, len(ids) - lead - second, remaining, length)
        return flip <= rule.error
    if rule.kind == "margin":
        return lead - second >= rule.margin
    if rule.kind == "beta":
        return _beta_confidence(lead, second) >= 1.0 - rule.error
    if rule.kind == "window":
        tail = list(ids[-rule.window:])
        return len(tail) == rule.window and all(i == ranked[0][0] for i in tail)
    if rule.kind == "sequential":
        bound = sequential_boundary(len(ids) + remaining, rule.error)[0][len(ids)]
        return bound is not None and lead >= bound
    # predictive
    counts = tuple(c for _, c in ranked)
    return _flip_probability(counts, len(ids) - votes, remaining) <= rule.error


def stop_answer(ids: Sequence[int | None], rule: StopRule | None = None) -> int | None:
    """The class a rule answers with after ``ids``: the vote's winner (ties:
    the class seen first), but for ``esc`` a last window of one answer's."""
    if rule is not None and rule.kind == "esc" and ids and len(ids) % rule.window == 0 \
            and len(set(ids[-rule.window:])) == 1:
        return ids[-1]
    ranked = tally(ids)
    return ranked[0][0] if ranked else None


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
    return lru_sizes(sequential_boundary, _beta_confidence, _flip_probability, overtake)


def _betabinom_pmf(k, n, a: float, b: float):
    from scipy.special import betaln, gammaln  # imported on use: keeps the package import light
    return np.exp(gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1)
                  + betaln(k + a, n - k + b) - betaln(a, b))
