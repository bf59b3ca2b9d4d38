"""Equivalence-aware voting over sampled final answers.

Answers are clustered into classes of mathematically equal answers
(``1/2``, ``0.5``, ``\\frac{1}{2}`` and ``\\dfrac12`` are one class).  Cheap
canonical strings are grouped first; math-verify is then asked only between
a new group and the existing class representatives, and numeric fingerprints
skip most of those calls, so N=64 samples cost about one parse per distinct
answer rather than N^2 sympy comparisons.

Tie-break (documented, deterministic): among classes with equal total weight
the class whose first member appears earliest in the input wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .answers import DEFAULT_TIMEOUT_S, Canonical, canonicalize, equivalent

__all__ = [
    "AnswerClass",
    "BestOfN",
    "VoteResult",
    "best_of_n",
    "cluster_answers",
    "logprob_weights",
    "majority_vote",
]


@dataclass
class AnswerClass:
    """One class of equal answers.  ``answer`` is its earliest member's text."""

    answer: str
    members: list[int]  # indices into the voted list, ascending
    weight: float

    @property
    def count(self) -> int:
        return len(self.members)

    @property
    def first_index(self) -> int:
        return self.members[0]


@dataclass
class VoteResult:
    answer: str | None  # winning class's representative; None if nobody voted
    classes: list[AnswerClass]  # winner first, then by weight, then first index
    agreement: float  # winner weight / total weight; 0.0 if nobody voted
    assignment: list[int | None]  # per input: index into ``classes`` or None
    total_weight: float = 0.0

    @property
    def winner(self) -> AnswerClass | None:
        return self.classes[0] if self.classes else None

    @property
    def counts(self) -> dict[str, int]:
        """Votes per class, keyed by the class representative."""
        return {c.answer: c.count for c in self.classes}

    @property
    def num_votes(self) -> int:
        return sum(c.count for c in self.classes)

    @property
    def num_abstained(self) -> int:
        return sum(a is None for a in self.assignment)

    @property
    def margin(self) -> float:
        """Weight by which the winner leads the runner-up."""
        if not self.classes:
            return 0.0
        second = self.classes[1].weight if len(self.classes) > 1 else 0.0
        return self.classes[0].weight - second


def cluster_answers(
    answers: Sequence[str | None], timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[int | None]:
    """Class id per answer (ids numbered by first appearance); None and blank
    answers get None.

    Groups with equal canonical strings are merged for free.  Remaining groups
    are visited most-frequent first and each joins the first existing class
    whose representative math-verify judges equal (equality is not always
    transitive, e.g. ``50%`` ~ ``50`` and ``50%`` ~ ``0.5``; this greedy pass
    keeps the outcome deterministic).
    """
    canon_cache: dict[str, Canonical] = {}
    groups: dict[str, list[int]] = {}  # canonical key -> member indices
    group_canon: dict[str, Canonical] = {}
    for i, a in enumerate(answers):
        if a is None or not a.strip():
            continue
        c = canon_cache.get(a)
        if c is None:
            c = canon_cache[a] = canonicalize(a)
        groups.setdefault(c.key, []).append(i)
        group_canon.setdefault(c.key, c)

    reps: list[Canonical] = []
    class_of_group: dict[str, int] = {}
    for key in sorted(groups, key=lambda k: (-len(groups[k]), groups[k][0])):
        c = group_canon[key]
        for cid, rep in enumerate(reps):
            if equivalent(rep, c, timeout_s):
                class_of_group[key] = cid
                break
        else:
            class_of_group[key] = len(reps)
            reps.append(c)

    raw = [class_of_group[canon_cache[a].key] if a in canon_cache else None for a in answers]
    # Renumber by first appearance so ids don't depend on the visiting order.
    order: dict[int, int] = {}
    for cid in raw:
        if cid is not None and cid not in order:
            order[cid] = len(order)
    return [None if cid is None else order[cid] for cid in raw]


def majority_vote(
    answers: Sequence[str | None],
    weights: Sequence[float] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> VoteResult:
    """Vote over extracted answers; ``None`` and blank answers abstain.

    ``weights`` (one non-negative float per answer, default 1.0) lets a vote
    count more, e.g. :func:`logprob_weights`.  ``timeout_s`` bounds each
    math-verify parse/compare (a timeout counts as "not equal").
    """
    if weights is None:
        weights = [1.0] * len(answers)
    if len(weights) != len(answers):
        raise ValueError(f"{len(weights)} weights for {len(answers)} answers")
    for w in weights:
        if not (w >= 0.0 and math.isfinite(w)):
            raise ValueError(f"weights must be finite and >= 0, got {w!r}")

    ids = cluster_answers(answers, timeout_s)
    classes: dict[int, AnswerClass] = {}
    for i, cid in enumerate(ids):
        if cid is None:
            continue
        if cid not in classes:
            classes[cid] = AnswerClass(answer=answers[i], members=[], weight=0.0)
        classes[cid].members.append(i)
        classes[cid].weight += float(weights[i])

    total = sum(c.weight for c in classes.values())
    # Round so float summation order cannot break a genuine tie.
    scale = total if total > 0 else 1.0
    ordered = sorted(
        classes.items(), key=lambda kv: (-round(kv[1].weight / scale, 9), kv[1].first_index)
    )
    rank = {cid: r for r, (cid, _) in enumerate(ordered)}
    ranked = [c for _, c in ordered]
    winner = ranked[0] if ranked else None
    return VoteResult(
        answer=winner.answer if winner else None,
        classes=ranked,
        agreement=(winner.weight / total) if winner and total > 0 else 0.0,
        assignment=[None if cid is None else rank[cid] for cid in ids],
        total_weight=total,
    )


def logprob_weights(
    logprobs: Sequence[float | None],
    method: str = "exp_mean",
    temperature: float = 1.0,
) -> list[float]:
    """Vote weights from per-sample log-probabilities.

    ``"exp_mean"`` (default): pass *mean* token logprobs; weight =
    exp(mean / T), the geometric-mean token probability in (0, 1].  Length
    normalised, so long chains are not punished, and bounded by 1 (which the
    early-stop rule relies on).
    ``"softmax"``: weight = softmax(logprob / T) over the samples; pass either
    mean or cumulative logprobs.  Sums to 1 and, with cumulative logprobs,
    tends to hand the vote to a single sample.
    A missing (None) logprob raises ValueError rather than silently dropping
    a vote; pass -inf for weight 0.
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    if any(lp is None or math.isnan(lp) for lp in logprobs):
        raise ValueError("every sample needs a logprob (request logprobs from vLLM)")
    scaled = [lp / temperature for lp in logprobs]  # type: ignore[operator]
    if method == "exp_mean":
        return [math.exp(min(0.0, s)) for s in scaled]
    if method == "softmax":
        if not scaled or max(scaled) == -math.inf:
            return [0.0] * len(scaled)
        top = max(scaled)
        exps = [math.exp(s - top) for s in scaled]
        z = sum(exps)
        return [e / z for e in exps]
    raise ValueError(f"unknown method {method!r}")


@dataclass
class BestOfN:
    index: int
    score: float
    sample: Any = field(repr=False)


def _field(sample: Any, name: str) -> Any:
    if isinstance(sample, dict):
        return sample.get(name)
    return getattr(sample, name, None)


def best_of_n(
    samples: Sequence[Any],
    scorer: str | Callable[[Any], float | None] = "mean_logprob",
    require_answer: bool = True,
) -> BestOfN | None:
    """Pick the single highest-scoring sample (no voting).

    ``scorer`` names a sample attribute/dict key ("mean_logprob",
    "cumulative_logprob", ...) or is a callable returning a float.  Samples
    scoring None are skipped; with ``require_answer`` samples whose ``answer``
    is None are skipped unless no sample has an answer.  Ties go to the
    earliest sample.  Returns None if nothing can be scored.
    """
    score = scorer if callable(scorer) else (lambda s: _field(s, scorer))
    scored = []
    for i, s in enumerate(samples):
        value = score(s)
        if value is not None and not math.isnan(value):
            scored.append((i, float(value), s))
    if require_answer and any(_field(s, "answer") is not None for _, _, s in scored):
        scored = [t for t in scored if _field(t[2], "answer") is not None]
    if not scored:
        return None
    i, value, s = max(scored, key=lambda t: (t[1], -t[0]))
    return BestOfN(index=i, score=value, sample=s)
