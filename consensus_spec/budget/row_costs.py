"""What one more batch row costs a step, learned from timed steps.

The draft budget asks what a draft token costs at a given batch size
(:mod:`.online`).  Starting a request's later paths early asks a different
question: how much slower every step gets with more rows, relative to the
step, the step time's elasticity in rows

    kappa(B) = B * dT/dB / T(B).

Each timed step (rows B, draft tokens D verified, time T) goes into one
bucket per octave of B: decayed sums of a linear regression
T = a + b B + c D.  Asked at B, the buckets are pooled with weights
falling off by a Gaussian in log2 B (one octave wide): a local linear fit,
so a roofline (flat at small B, linear beyond) keeps its two regimes.  The
row's own drafts count with it: dT/dB = b + c d(B), d the draft tokens
per row seen near B.  Until enough steps at varied B were seen near B
(one batch size alone says nothing of the slope), kappa leans on the prior
model's, which is free of its absolute scale (a prior fitted on
another machine or model is wrong by a factor first of all).
"""

from __future__ import annotations

import math

import numpy as np

from .cost_models import StepCostModel

__all__ = ["RowStepCosts"]

OCTAVES = 17  # buckets for B in [1, 2**16]
DECAY = 0.995  # per step in a bucket: a memory of a few hundred steps
WIDTH_OCTAVES = 1.0  # the pooling kernel's standard deviation
PRIOR_STEPS = 10.0  # steps near B (at varied B) at which the data weighs as much as the prior
OUTLIER = 4.0  # a step this many times its prediction is a hiccup: clipped to it
SPREAD = 0.25  # B's spread (relative) near the query at which the steps count in full


class RowStepCosts:
    """kappa(B) and T(B) from the engine's own steps, a model as the prior."""

    def __init__(self, prior: StepCostModel | None):
        self.prior = prior
        # per bucket: decayed [n, B, D, T, BB, BD, DD, BT, DT, D/B]
        self._sums = np.zeros((OCTAVES, 10))
        self.steps_observed = 0
        self.steps_clipped = 0

    @staticmethod
    def _bucket(batch: float) -> int:
        return min(OCTAVES - 1, max(0, int(round(math.log2(max(batch, 1.0))))))

    def observe(self, batch: int, drafted: int, step_ms: float) -> bool:
        """One step of ``batch`` rows that verified ``drafted`` draft tokens
        took ``step_ms``; False if it was not used (bad numbers)."""
        if batch < 1 or drafted < 0 or not (step_ms > 0 and math.isfinite(step_ms)):
            return False
        fit = self._fit(batch)
        if fit is not None:
            a, b, c, _, n = fit
            predicted = a + b * batch + c * drafted
            if n >= PRIOR_STEPS and predicted > 0 and step_ms > OUTLIER * predicted:
                step_ms = OUTLIER * predicted
                self.steps_clipped += 1
        s = self._sums[self._bucket(batch)]
        s *= DECAY
        s += (1.0, batch, drafted, step_ms, batch * batch, batch * drafted, drafted * drafted,
              batch * step_ms, drafted * step_ms, drafted / batch)
        self.steps_observed += 1
        return True

    def _fit(self, batch: float):
        """(a, b, c, drafts per row, steps weighed by how much B varied) of
        the local fit at ``batch``, or None before any step."""
        centre = math.log2(max(batch, 1.0))
        w = np.exp(-0.5 * ((np.arange(OCTAVES) - centre) / WIDTH_OCTAVES) ** 2)
        n, sb, sd, st, sbb, sbd, sdd, sbt, sdt, sdr = w @ self._sums
        if n < 1e-9:
            return None
        xtx = np.array([[n, sb, sd], [sb, sbb, sbd], [sd, sbd, sdd]])
        xty = np.array([st, sbt, sdt])
        ridge = 1e-6 * np.diag([1.0, max(sbb / n, 1.0), max(sdd / n, 1.0)]) * n
        try:
            a, b, c = np.linalg.solve(xtx + ridge, xty)
        except np.linalg.LinAlgError:
            return None
        if b < 0 or c < 0:  # a step never gets cheaper with more work: refit without it
            keep = [i for i, v in ((1, b), (2, c)) if v >= 0]
            idx = [0] + keep
            sol = np.linalg.solve((xtx + ridge)[np.ix_(idx, idx)], xty[idx])
            coef = dict(zip(idx, sol))
            a, b, c = coef.get(0, 0.0), coef.get(1, 0.0), coef.get(2, 0.0)
        # the slope is only known where B varied: weigh the data by the spread of B
        spread = max(sbb / n - (sb / n) ** 2, 0.0) / max(batch, 1.0) ** 2
        return float(a), float(b), float(c), float(sdr / n), float(n * min(1.0, spread / SPREAD ** 2))

    def step_ms(self, batch: int) -> float | None:
        """The learned step time at ``batch`` rows with the drafts seen there."""
        fit = self._fit(batch)
        if fit is None:
            return None
        a, b, c, d, _ = fit
        return a + (b + c * d) * batch

    def prior_kappa(self, batch: int, extra: int = 1) -> float:
        if self.prior is None:
            return 0.0
        t0 = float(self.prior.step_ms(batch, 1.0))
        t1 = float(self.prior.step_ms(batch + extra, 1.0))
        return batch * (t1 - t0) / (extra * t0) if t0 > 0 else 0.0

    def kappa(self, batch: int, extra: int = 1) -> float:
        """B (T(B + extra) - T(B)) / (extra T(B)), in [0, 1] (the data's
        local slope, shrunk towards the prior's kappa while data is thin)."""
        if batch <= 0:
            return 0.0
        prior = self.prior_kappa(batch, extra)
        fit = self._fit(batch)
        if fit is None:
            return min(1.0, max(0.0, prior))
        a, b, c, d, n = fit
        t = a + (b + c * d) * batch
        data = batch * (b + c * d) / t if t > 0 else prior
        mixed = (n * data + PRIOR_STEPS * prior) / (n + PRIOR_STEPS)
        return min(1.0, max(0.0, mixed))

    def summary(self, batches=(1, 4, 16, 64, 256)) -> dict:
        out = {}
        for b in batches:
            fit = self._fit(b)
            out[b] = {"ms": None if fit is None else round(self.step_ms(b), 3),
                      "kappa": round(self.kappa(b), 3),
                      "prior_kappa": round(min(1.0, max(0.0, self.prior_kappa(b))), 3),
                      "steps_near": 0.0 if fit is None else round(fit[4], 1)}
        return out
