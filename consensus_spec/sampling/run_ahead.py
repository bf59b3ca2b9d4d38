"""Run-ahead: which later waves of a problem to start before its vote asks
for them (pure logic, no vLLM).

A wave started early shortens the problem's time to its answer, but its
paths are wasted if the vote stops first.  A path of wave j is worth the
chance ``q`` that the stop rule will still need it: that no look before
wave j stops the problem.  It costs the other rows of the batch the extra
step time one more row brings.  With B rows in the batch, s more rows that
are each needed with chance q raise the rows of useful work per unit of
time, (B + q s) / T(B + s) > B / T(B), exactly when

    q > kappa(B, s) = B (T(B + s) - T(B)) / (s T(B)),

the step time's elasticity in rows.  That counts rows of work; a client
waits for answers, and a problem's answer waits for its waves one after
another.  A wave needed and opened early saves its problem one later
wave's time, T(B - r + s) a step (the batch without this problem's rows
but with the wave); the s rows cost every problem in flight T(B + s) - T(B)
a step.  With k problems in flight holding r rows each (B = k r), the sum
of their latencies (by Little's law, what answers per second a fixed set
of clients get) falls exactly when

    q > k (T(B + s) - T(B)) / T(B - r + s)
      = kappa(B, s) (s / r) T(B) / T(B - r + s),

the ``latency`` objective, the default.  For one problem alone on a step
that grows linearly, T = a + b B, that is s b / (a + b s): where a row is
cheap beside the step's fixed cost, every wave starts at once.  With r <= s
it is the rows-of-work criterion, which ``throughput`` keeps throughout.

That criterion is local: each wave it opens looks worth its rows, and with
many problems in flight it opens nearly all of them, which a closed loop of
clients on this CPU (and a simulation of one on its measured step costs)
answered more slowly than the rows-of-work criterion did: 1.28x against
1.52x the answers per second of plain n=16 clients at 16 clients, in the
simulation.  Alone, the latency criterion is the better one (1.45x against
1.25x).  So the latency objective takes the stricter of the two, the
rows-of-work one weighed in as others share the batch: with k = B / r
problems in flight, q must beat kappa(B, s) min(1, (k - 1) / SHARED_PROBLEMS)
too.  On an idle GPU at a small batch the
step barely grows with B (kappa near 0: every wave starts at once); on a
CPU, or a batch near its compute bound, kappa nears 1 and only paths
almost sure to be needed start.  T comes from whatever measures the
engine's step (:class:`RowCosts`); ``q`` from :func:`need_probability`,
the stop rule itself run forward on the answers seen so far.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from ..voting.answers import normalize_answer
from .answer_prior import AnswerPrior
from .stopping import StopRule, should_stop_ids

__all__ = ["RowCosts", "RunAhead", "RunAheadStats", "need_probability", "tally_keys"]

NEED_CACHE_SIZE = 1 << 16
_NEED_CACHE: dict = {}  # keyed by the prior's key, not the prior: a server's runs come and go
NONE_PSEUDO = 0.5  # prior weight of "no answer" in the predictive (answers are the usual case)
SHARED_PROBLEMS = 3.0  # problems beside this one at which the rows-of-work criterion binds in full
LATE_WORTH = 0.5  # a late run opens the waves its vote more likely needs than not


class RowCosts(Protocol):
    """What one more row costs the engine now."""

    def rows(self) -> int:
        """Rows in the engine's batch now (all requests, not only ours)."""

    def elasticity(self, rows: int, extra: int) -> float:
        """``rows * (T(rows + extra) - T(rows)) / (extra * T(rows))``."""


def tally_keys(answers: Sequence[Any]) -> tuple[tuple[int, ...], int]:
    """(vote counts ranked, most first; paths without an answer) by canonical
    key: cheap (no math-verify), so it may merge less than the vote does."""
    counts: dict[str, int] = {}
    none = 0
    for a in answers:
        if a is None or not str(a).strip():
            none += 1
            continue
        key = normalize_answer(str(a))
        counts[key] = counts.get(key, 0) + 1
    return tuple(sorted(counts.values(), reverse=True)), none


def _ids(counts: Sequence[int], none: int) -> list[int | None]:
    out: list[int | None] = []
    for cid, c in enumerate(counts):
        out += [cid] * c
    return out + [None] * none


def cache_sizes() -> dict[str, list[int]]:
    """Run-ahead's memo: [entries held, bound]."""
    return {"need_probability": [len(_NEED_CACHE), NEED_CACHE_SIZE]}


def need_probability(counts: tuple[int, ...], none: int, looks: tuple[int, ...], n: int,
                     rule: StopRule, prior: AnswerPrior | None = None) -> float:
    """P(the stop rule stops at none of ``looks``) given the answers seen.

    ``counts``: vote counts ranked (most first), ``none``: paths without an
    answer; ``looks``: cumulative paths at each look still to come (each
    < n), in order.  The paths not seen yet come from a Polya urn over
    three outcomes (the leader's answer, another answer, none) with the
    counts seen plus one (``NONE_PSEUDO`` for none) as its weights; another
    answer joins the runner-up (the case that stops least).  A look at
    fewer paths than were seen is taken on the answers seen.  ``prior``: the
    run's :class:`AnswerPrior` a ``bayes`` rule votes with.
    """
    key = (counts, none, looks, n, rule, None if prior is None else prior.key)
    hit = _NEED_CACHE.get(key)
    if hit is None:
        if len(_NEED_CACHE) >= NEED_CACHE_SIZE:
            _NEED_CACHE.clear()
        hit = _NEED_CACHE[key] = _need(counts, none, looks, n, rule, prior)
    return hit


def _need(counts: tuple[int, ...], none: int, looks: tuple[int, ...], n: int, rule: StopRule,
          prior: AnswerPrior | None) -> float:
    seen = sum(counts) + none
    lead, second = (counts[0] if counts else 0), (counts[1] if len(counts) > 1 else 0)
    rest = tuple(counts[2:])
    alive = {(0, 0, 0): 1.0}  # new (leader, other, none) draws -> P(no stop so far)
    drawn = 0
    for look in looks:
        grow = max(0, look - seen - drawn)
        if grow:
            alive = _draw(alive, grow, lead + 1.0, sum(counts[1:]) + 1.0, none + NONE_PSEUDO)
            drawn += grow
        nxt = {}
        for (dl, do, dn), p in alive.items():
            ranked = sorted((lead + dl, second + do) + rest, reverse=True)
            ids = _ids(ranked, none + dn)
            if not should_stop_ids(ids, n - len(ids), rule, prior=prior):
                nxt[(dl, do, dn)] = p
        alive = nxt
        if not alive:
            return 0.0
    return min(1.0, sum(alive.values()))


def _draw(alive: dict, k: int, a_lead: float, a_other: float, a_none: float) -> dict:
    """Each state's next ``k`` draws from the urn, state by state."""
    out: dict = {}
    for (dl, do, dn), p in alive.items():
        states = {(dl, do, dn): p}
        for _ in range(k):
            step: dict = {}
            for (l, o, m), q in states.items():
                wl, wo, wn = a_lead + l, a_other + o, a_none + m
                total = wl + wo + wn
                for key, w in (((l + 1, o, m), wl), ((l, o + 1, m), wo), ((l, o, m + 1), wn)):
                    step[key] = step.get(key, 0.0) + q * w / total
            states = step
        for key, q in states.items():
            out[key] = out.get(key, 0.0) + q
    return out


@dataclass
class RunAheadStats:
    """What run-ahead decided, for a server's state and a benchmark's table."""

    opened: int = 0  # waves started early
    declined: int = 0  # candidate waves whose worth did not beat their cost
    worth_sum: float = 0.0  # sum of q over the waves opened
    last_kappa: float | None = None
    last_rows: int | None = None

    def merge(self, other: "RunAheadStats") -> None:
        self.opened += other.opened
        self.declined += other.declined
        self.worth_sum += other.worth_sum
        if other.last_kappa is not None:
            self.last_kappa, self.last_rows = other.last_kappa, other.last_rows

    def as_dict(self) -> dict:
        return {"opened": self.opened, "declined": self.declined,
                "mean_worth_opened": round(self.worth_sum / self.opened, 4) if self.opened else None,
                "last_kappa": None if self.last_kappa is None else round(self.last_kappa, 4),
                "last_rows": self.last_rows}


@dataclass
class RunAhead:
    """Chooses the waves to open early: best worth first, while worth beats
    cost (see the module docstring).  ``costs`` None: every row is free
    (kappa 0), which opens every candidate the spare rows allow."""

    rule: StopRule | None
    costs: RowCosts | None = None
    objective: str = "latency"  # or "throughput" (module docstring)
    stats: RunAheadStats = field(default_factory=RunAheadStats)
    prior: AnswerPrior | None = None  # the run's, for a "bayes" rule (PathBook sets it)
    # () -> the run is late (its problems have run longer than answers take): its waves
    # then open at LATE_WORTH, whatever rows cost, so the tail of answers does not wait on
    # wave after wave (a server knows the time answers take; None: never late)
    late: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        if self.objective not in ("latency", "throughput"):
            raise ValueError(f"RunAhead.objective must be 'latency' or 'throughput', "
                             f"got {self.objective!r}")

    def worth(self, answers: Sequence[Any], looks: Sequence[int], n: int) -> float:
        """P(the rule still needs the wave after ``looks``)."""
        if self.rule is None or not looks:
            return 1.0
        counts, none = tally_keys(answers)
        return need_probability(counts, none, tuple(looks), n, self.rule, self.prior)

    def kappa(self, rows: int, extra: int) -> float:
        if self.costs is None or extra <= 0 or rows <= 0:
            return 0.0
        return min(1.0, max(0.0, float(self.costs.elasticity(rows, extra))))

    def _latency_kappa(self, kappa: float, rows: int, s: int, r: float) -> float:
        """The larger of kappa(B, s) (s / r) T(B) / T(B - r + s), T's ratio
        from the elasticity over the r - s rows between, and kappa(B, s)
        weighed by the problems sharing the batch (module docstring)."""
        if r <= s or self.costs is None:
            return kappa
        base = max(1, round(rows - r + s))
        if base >= rows:
            return kappa
        ratio = 1.0 + max(0.0, float(self.costs.elasticity(base, rows - base))) * (rows - base) / base
        latency = min(1.0, kappa * (s / r) * ratio)
        shared = min(1.0, max(0.0, (rows / r - 1.0) / SHARED_PROBLEMS))
        return max(latency, kappa * shared)

    def choose(self, candidates: list[tuple[float, int, int]], spare: int, rows: int,
               next_candidate: Callable[[int], tuple[float, int] | None],
               own: tuple[int, int] | None = None) -> list[int]:
        """Problems whose next wave to open, in order (a problem may appear
        more than once: its following wave).  ``candidates``: (worth, size,
        problem); ``next_candidate(p)``: p's following wave once this one
        is open, as (worth, size), or None.  ``own``: (rows, problems) the
        caller has in flight, for the latency objective's r (None: r = s,
        the throughput criterion)."""
        if rows < 0:
            rows = 0
        own_rows, own_problems = own if own is not None else (0, 0)
        heap = [(-q, p, s) for q, s, p in candidates]
        heapq.heapify(heap)
        opened: list[int] = []
        while heap and spare > 0:
            q, p, s = heapq.heappop(heap)
            q = -q
            if s > spare:
                continue
            kappa = self.kappa(rows, s)
            if self.objective == "latency" and own_problems > 0:
                kappa = self._latency_kappa(kappa, rows, s, own_rows / own_problems)
            if self.late is not None and self.late():
                kappa = min(kappa, LATE_WORTH)
            self.stats.last_kappa, self.stats.last_rows = kappa, rows
            if q <= kappa:
                self.stats.declined += 1 + len(heap)
                break  # the rest are worth no more
            opened.append(p)
            self.stats.opened += 1
            self.stats.worth_sum += q
            rows, spare, own_rows = rows + s, spare - s, own_rows + s
            following = next_candidate(p)
            if following is not None:
                heapq.heappush(heap, (-following[0], p, following[1]))
        return opened
