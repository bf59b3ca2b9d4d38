"""Step costs from a measured prior, and learning only where the engine disagrees.

A measured table ({"B", "q", "ms"} rows timed on this machine: the start-up
profile, or what an earlier run learned and remembered, see
:mod:`.remember`) lends each bucket it covers ``SEED_WEIGHT`` pseudo-steps
of its own points, so the fit starts where the table says, with the
certainty of a few dozen steps; real steps then refine it and the
pseudo-steps are forgotten as they come (``DECAY``).

While the fit stays within its own uncertainty (and a tolerance) of the
table, for the step time at the bucket's drafting level and for one more
draft token per row, the bucket is *settled*: it never explores and the
guard's windows of plain steps come only once in its ``MAX_PERIOD`` steps
there (the table says what drafts cost the engine; a window checks that
drafting also pays for the drafter's own time). When the engine disagrees,
most of the table's weight is dropped and the bucket learns as it would
without a measurement, exploring while uncertain; once that stops (the
answer is clear) the fit becomes the bucket's new reference and it is
settled again.

A bucket whose budget drafts nothing has no evidence left on what a draft
costs: a table (or a fit) that overstates it would keep drafting off for
good, and no window or exploration could tell (both compare against the
budget's own choice, which is no drafts). So such a bucket *probes* now and
then: a few steps in a row draft what a tenth of the believed cost would
allow, one token on a quarter of the rows at most. A probe step far faster
than the fit predicts shows the table wrong: the bucket relearns, from that
step on. One no faster than predicted leaves the fit as it was (the bucket
drafts nothing either way). Probes that agree grow rarer.
"""

from __future__ import annotations

import math

import numpy as np

from . import online
from .online import (BUCKETS_PER_OCTAVE, COUNT, DRAFTED, DRAFTER, DRAFTER_N, EXPLORE_ABOVE,
                     EXPLORE_EVERY, EXPLORE_STEP_SHARE, MAX_BUCKETS, MEASURED, MIN_EFFECTIVE,
                     MIN_NOISE, NOISE, OBSERVED, PRIOR, REF, REJECTS, THETA, XTX, XTY,
                     OnlineStepCosts, bucket_of)

SEED_WEIGHT = 30.0   # pseudo-steps a measured table lends each bucket it covers
DISCOUNT = 0.1       # share of a bucket's evidence kept when the engine disagrees with it
AGREE_SIGMAS = 3.0   # the fit may stray this many of its sds from the table...
LEVEL_TOL = 0.05     # ...and this share of the step time, whatever its uncertainty
SLOPE_TOL = 0.15     # ...and this share of the table's cost of a draft token per row
CHECK_EVERY = 8      # real steps between checks in a settled bucket
REJECTS_DISAGREE = 3  # outliers in a row that say the table is wrong
Q_POINTS = (1, 2, 3, 5, 9)  # query lengths per row a saved table holds
SETTLED, RELEARNING = 1.0, 2.0
PROBE_FIRST = 128    # steps drafting nothing before a bucket's first probe...
PROBE_MAX = 1024     # ...the wait doubling to this while probes agree with the fit
PROBE_STEPS = 3      # steps in a row per probe
PROBE_SHADE = 0.9    # a probe drafts as if a draft token cost a tenth of the estimate
IDLE_DRAFTS = 0.5    # a bucket drafting fewer tokens per step than this is drafting nothing


class MeasuredStepCosts(OnlineStepCosts):
    """:class:`OnlineStepCosts` that can start from a measured table."""

    def __init__(self, prior):
        super().__init__(prior)
        self.disagreements = 0  # settled buckets the engine's steps contradicted
        self.resettled = 0      # of those, relearned until clear and settled again
        self._checks = [0] * MAX_BUCKETS
        self._relearn_from = [0.0] * MAX_BUCKETS  # real steps seen when relearning began
        self._tables: dict[int, list[dict]] = {}  # a bucket's seed rows, while the engine agrees
        self._probe_wait = [PROBE_FIRST] * MAX_BUCKETS   # steps between probes, per bucket
        self._probe_countdown = [PROBE_FIRST] * MAX_BUCKETS
        self._probe_left = [0] * MAX_BUCKETS  # steps left in the probe under way
        self._probed = -1       # the bucket the last decision probed, until its step is observed
        self.probing = False    # the last decision is a probe (the budget takes its drafts as they are)
        self.steps_probed = 0

    def seed(self, rows: list[dict]) -> int:
        """Start the buckets these rows cover from them: ``{"B", "q", "ms"}``
        with optional ``noise`` (relative sd of one measurement) and
        ``drafter_ms``. Returns the buckets seeded; raises ValueError on a
        malformed row (nothing seeded then)."""
        groups: dict[int, list[tuple[int, float, float, float, float]]] = {}
        for r in rows:
            b_rows, q, ms = int(r["B"]), float(r["q"]), float(r["ms"])
            noise, drafter = float(r.get("noise", 0.0)), float(r.get("drafter_ms", 0.0))
            if b_rows < 1 or not 1.0 <= q <= 65.0 or not (0.0 < ms < 1e6) \
                    or not (0.0 <= noise < 1.0) or not (0.0 <= drafter < 1e6):
                raise ValueError(f"bad step-cost row {r!r}")
            groups.setdefault(bucket_of(b_rows), []).append((b_rows, q, ms, noise, drafter))
        state = self._state
        for b, pts in groups.items():
            self._tables[b] = [{"B": b_rows, "q": q, "ms": ms, "noise": noise}
                               for b_rows, q, ms, noise, _ in pts]
        for b, pts in groups.items():
            s = state[b]
            s[XTX:XTX + 9] = 0.0
            s[XTY:XTY + 3] = 0.0
            w = SEED_WEIGHT / len(pts)
            level, noises, drafter = math.inf, [], 0.0
            for b_rows, q, ms, noise, d in pts:
                m = int(round((q - 1.0) * b_rows))
                base, inc = self._prior_at(b_rows, m)
                x = np.array([1.0, m / b_rows, inc[m]])
                s[XTX:XTX + 9] += w * np.outer(x, x).ravel()
                s[XTY:XTY + 3] += w * x * (ms / base)
                level = min(level, ms / base)
                noises.append(noise)
                drafter = max(drafter, d / base)
            s[COUNT] = SEED_WEIGHT
            s[NOISE] = (max(float(np.mean(noises)), MIN_NOISE) * level) ** 2
            prec, rhs, out = np.empty((3, 3)), np.empty(3), np.empty(3)
            online.posterior(state, b, level, prec, rhs)
            online.fit(prec, rhs, out)
            s[THETA:THETA + 3] = out
            self._settle(b)
            s[DRAFTER], s[DRAFTER_N] = drafter, 1.0  # the drafter's real time replaces it at once
            self._started[b] = True
        return len(groups)

    def _settle(self, b: int) -> None:
        """The fit becomes the bucket's reference and its prior's centre: once
        its pseudo-steps are forgotten, steps that all draft alike (which say
        nothing of the slope) leave it where the table put it, not where the
        model prior would."""
        s = self._state[b]
        a, c1, c2 = s[THETA:THETA + 3]
        s[REF:REF + 3] = (a, c1, c2)
        s[PRIOR:PRIOR + 3] = (a, c1, c2 / a if a > 0 else 1.0)
        s[MEASURED] = SETTLED

    def settled(self, batch: int) -> bool:
        """The bucket of ``batch`` follows a measured table the engine agrees with."""
        return self._state[bucket_of(batch), MEASURED] == SETTLED

    def observe(self, batch: int, drafted: int, step_ms: float, drafter_ms: float) -> bool:
        b = bucket_of(batch)
        probe = batch >= 1 and self._probed == b
        self._probed = -1
        if probe:
            predicted = float(self.step_ms(batch, drafted, drafter=False)[drafted])
            if step_ms >= predicted:
                # drafts cost at least what the fit believes: the bucket drafts nothing
                # either way, so the probe leaves the fit (and a settled answer) as it was
                return True
        ok = super().observe(batch, drafted, step_ms, drafter_ms)
        if batch >= 1:
            state = self._state
            if probe and not ok:
                # a probe far faster than the fit says (no stall makes a step faster):
                # drafts cost less than it believes; it is the evidence, so learn from it
                self._disagree(b)
                state[b, REJECTS] = online.MAX_REJECTS
                ok = super().observe(batch, drafted, step_ms, drafter_ms)
            elif state.item(b, MEASURED) == SETTLED:
                self._checks[b] += 1
                if state.item(b, REJECTS) >= REJECTS_DISAGREE or (
                        self._checks[b] % CHECK_EVERY == 0 and not self._agrees(batch, b)):
                    self._disagree(b)
        return ok

    def _agrees(self, batch: int, b: int) -> bool:
        """The fit is within its uncertainty (or the tolerances) of the
        bucket's reference, at its drafting level and for one more token per row."""
        s = self._state[b]
        m0 = int(round(s[DRAFTED] * batch))
        _, inc = self._prior_at(batch, m0 + batch)
        at = np.array([1.0, m0 / batch, inc[m0]])
        more = np.array([0.0, 1.0, inc[m0 + batch] - inc[m0]])
        theta, ref = s[THETA:THETA + 3], s[REF:REF + 3]
        level = max(float(ref @ at), 1e-3)
        slope_tol = max(SLOPE_TOL * abs(float(ref @ more)) / level, EXPLORE_STEP_SHARE)
        for v, tol in ((at, LEVEL_TOL), (more, slope_tol)):
            diff = abs(float((theta - ref) @ v)) / level
            sd = online.contrast_sd(self._state, b, v[0], v[1], v[2]) / level
            if diff > max(AGREE_SIGMAS * sd, tol):
                return False
        return True

    def _disagree(self, b: int) -> None:
        s = self._state[b]
        s[XTX:XTX + 9] *= DISCOUNT  # uncertain again: exploration resumes
        s[XTY:XTY + 3] *= DISCOUNT
        s[COUNT] *= DISCOUNT
        s[MEASURED] = RELEARNING
        self._relearn_from[b] = s[OBSERVED]
        self._tables.pop(b, None)  # what is saved next is what the engine says
        self._probe_wait[b] = self._probe_countdown[b] = PROBE_FIRST
        self.disagreements += 1

    def _probe(self, batch: int, b: int) -> bool:
        """Whether this decision in bucket ``b`` is a probe step (see the module's doc)."""
        if self._probe_left[b] == 0:
            state = self._state
            if state.item(b, COUNT) < MIN_EFFECTIVE or state.item(b, DRAFTED) * batch >= IDLE_DRAFTS:
                self._probe_countdown[b] = self._probe_wait[b]  # it drafts: nothing to check
                return False
            self._probe_countdown[b] -= 1
            if self._probe_countdown[b] > 0:
                return False
            self._probe_left[b] = PROBE_STEPS
            self._probe_wait[b] = min(2 * self._probe_wait[b], PROBE_MAX)
            self._probe_countdown[b] = self._probe_wait[b]
        self._probe_left[b] -= 1
        self._probed = b
        self.steps_probed += 1
        return True

    def explore_shade(self, batch: int) -> float:
        b = self._bucket(batch)
        state = self._state
        self.probing = self._probe(batch, b)
        if self.probing:
            self._steps[b] += 1
            self.decisions += 1
            return PROBE_SHADE
        if state.item(b, MEASURED) == SETTLED:  # the table holds: nothing to learn by exploring
            self._steps[b] += 1
            self.decisions += 1
            return 0.0
        shade = self._explore_shade(batch, b)
        if state.item(b, MEASURED) == RELEARNING and shade == 0.0 \
                and self._steps[b] % EXPLORE_EVERY == 1 \
                and state.item(b, OBSERVED) - self._relearn_from[b] >= 2 * MIN_EFFECTIVE:
            relative, of_step = self.uncertainty(batch)
            if relative <= EXPLORE_ABOVE or of_step <= EXPLORE_STEP_SHARE:  # clear again
                self._settle(b)
                self.resettled += 1
        return shade

    def measured_buckets(self) -> int:
        return int(np.count_nonzero(self._state[:, MEASURED] == SETTLED))

    def export(self) -> list[dict]:
        """The fit as a measured table: for every bucket with enough evidence
        (and not relearning), step times at ``Q_POINTS`` (drafter excluded),
        with the bucket's noise and drafter time; what :meth:`seed` reads.
        A bucket whose seed table the engine never contradicted gives that
        table back as it came: the fit samples it at fewer points and through
        the steps seen (at a few drafting levels), so saving the fit would
        lose what the table said elsewhere and drift run by run."""
        rows = []
        for b in range(MAX_BUCKETS):
            s = self._state[b]
            if s[COUNT] < MIN_EFFECTIVE or s[MEASURED] == RELEARNING:
                continue
            if b in self._tables and s[MEASURED] == SETTLED:
                base = self._prior_at(self._tables[b][0]["B"], 0)[0]
                rows.extend({**r, "drafter_ms": round(float(s[DRAFTER] * base), 5)}
                            for r in self._tables[b])
                continue
            batch = int(round(2 ** (b / BUCKETS_PER_OCTAVE)))
            if bucket_of(batch) != b:
                continue
            t = self.step_ms(batch, (Q_POINTS[-1] - 1) * batch, drafter=False)
            base = self._prior_at(batch, 0)[0]
            noise = math.sqrt(s[NOISE]) / max(s[THETA], 1e-3)
            for q in Q_POINTS:
                rows.append({"B": batch, "q": q, "ms": round(float(t[(q - 1) * batch]), 5),
                             "noise": round(float(min(noise, 0.5)), 4),
                             "drafter_ms": round(float(s[DRAFTER] * base), 5)})
        return rows
