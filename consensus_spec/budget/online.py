"""Step costs learned where the engine runs.

The proposer times each engine step (from the end of one ``propose`` call
to the start of the next: forward pass, sampling, verification,
scheduling) and its own drafting, and charges each cleanly attributable
step to its B rows and the m draft tokens it verified. Per bucket of batch
sizes (four to an octave) a Bayesian linear regression with forgetting fits

    T(B, m) / P(B) = a + c1 * m / B + c2 * I(B, m)

where P(B) is the prior's one-token step time and I(B, m) the prior's
relative increment for m draft tokens, ``(T0(B, 1 + m/B) - P(B)) / P(B)``.
So ``a`` rescales the prior's step, ``c2`` rescales its draft-token cost and
``c1`` adds a cost linear in the tokens verified (what a CPU shows and an
H200 roofline lacks); c1 and c2 are kept >= 0. The prior pulls a to 1, c1
to 0 and c2 to a: a cold
start drafts as the prior would, a prior wrong by a uniform factor is
corrected by the first steps, and a wrong slope within tens of steps.

Only the marginal cost of a draft token relative to a step decides, so the
fit is judged by that. While it is uncertain enough to change a decision,
every ``EXPLORE_EVERY``-th step of a bucket drafts as a lower bound on the
cost would have it; the contrast with ordinary steps teaches the slope.
Exploration stops in a bucket once the lower and upper bounds choose the
same drafts. The drafter's own time enters the step time as a fixed cost.

Memory: a fixed array of ``MAX_BUCKETS`` buckets (B up to 2**16) and a
bounded cache of the prior's increments per batch size.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from ..jit import Kernels
from .cost_models import StepCostModel

kernel = Kernels(globals())

BUCKETS_PER_OCTAVE = 4
MAX_BUCKETS = 4 * 16 + 1
EXPLORE_EVERY = 4       # at most one step in this many explores, per bucket
EXPLORE_ABOVE = 0.1     # ...while the cost of a draft token is this uncertain (relative sd)
EXPLORE_STEP_SHARE = 0.01  # ...and its sd is this share of a step (below, no decision moves much)
DECAY = 0.99            # forgetting per observation in a bucket (~100-step memory)
PRIOR_SD = (1.0, 1.0, 1.0)  # prior spread of a (relative), c1, c2 (relative to a)
NOISE0 = 0.05           # relative noise assumed before any residual is seen
MIN_NOISE = 0.01        # relative: no machine times its steps better than this
REJECT_SIGMAS = 5.0     # residuals beyond this many sigmas are outliers...
MAX_REJECTS = 8         # ...unless this many come in a row (the level moved)
MIN_EFFECTIVE = 20.0    # observations before a bucket lends its fit to new ones


@kernel
def _solve(m, v, free, out):
    """out = m^-1 v over the free coordinates of a symmetric positive
    definite 3x3 system (the others held at 0): Gaussian elimination."""
    a = np.zeros((3, 4))
    idx = np.empty(3, np.int64)
    n = 0
    for i in range(3):
        out[i] = 0.0
        if free[i]:
            idx[n] = i
            n += 1
    for r in range(n):
        for c in range(n):
            a[r, c] = m[idx[r], idx[c]]
        a[r, 3] = v[idx[r]]
    for k in range(n):
        for r in range(k + 1, n):
            f = a[r, k] / a[k, k]
            for c in range(k, n):
                a[r, c] -= f * a[k, c]
            a[r, 3] -= f * a[k, 3]
    for k in range(n - 1, -1, -1):
        x = a[k, 3]
        for c in range(k + 1, n):
            x -= a[k, c] * out[idx[c]]
        out[idx[k]] = x / a[k, k]


@kernel
def _fit(prec, rhs, out):
    """Posterior mean with the cost coefficients c1, c2 kept >= 0 (a step
    never gets cheaper with more tokens): the unconstrained solution, else
    the best with the negative one held at 0, else a alone."""
    free = np.ones(3, np.bool_)
    _solve(prec, rhs, free, out)
    if out[1] >= 0.0 and out[2] >= 0.0:
        return
    best = -1.0
    best_q = 0.0
    keep = out.copy()
    trial = np.empty(3)
    for drop in (1, 2):
        free[:] = True
        free[drop] = False
        _solve(prec, rhs, free, trial)
        if trial[1] >= 0.0 and trial[2] >= 0.0:
            # quadratic objective at trial (lower is better): x.P.x - 2 x.rhs
            q = 0.0
            for i in range(3):
                q -= 2.0 * trial[i] * rhs[i]
                for j in range(3):
                    q += trial[i] * prec[i, j] * trial[j]
            if best < 0.0 or q < best_q:
                best, best_q = 1.0, q
                keep[:] = trial
    if best < 0.0:
        free[:] = False
        free[0] = True
        _solve(prec, rhs, free, keep)
    out[:] = keep


@kernel
def _posterior(b, xtx, xty, noise, prior_mean, prior_sd, theta_a, prec, rhs):
    """Precision matrix and right-hand side of bucket b's posterior. The
    prior on c2 is centred on r * a (r = prior_mean[b, 2]), and every prior
    spread is relative to the step's scale a: the prior speaks in shares of
    a step, whatever the machine's speed."""
    s2 = noise[b]
    for i in range(3):
        rhs[i] = xty[b, i] / s2
        for j in range(3):
            prec[i, j] = xtx[b, i, j] / s2
    scale = max(theta_a, 1e-3)
    pa = 1.0 / (prior_sd[0] * scale) ** 2
    p1 = 1.0 / (prior_sd[1] * scale) ** 2
    p2 = 1.0 / (prior_sd[2] * scale) ** 2
    a0, c10, r = prior_mean[b, 0], prior_mean[b, 1], prior_mean[b, 2]
    prec[0, 0] += pa + p2 * r * r
    rhs[0] += pa * a0
    prec[1, 1] += p1
    rhs[1] += p1 * c10
    prec[2, 2] += p2
    prec[0, 2] -= p2 * r
    prec[2, 0] -= p2 * r


@kernel
def _observe(b, x, y, xtx, xty, count, noise, rejects, theta, prior_mean, prior_sd, decay):
    """Add one step (features x, relative time y) to bucket b; refit.
    Returns False for an outlier left out."""
    r = y - (theta[b, 0] * x[0] + theta[b, 1] * x[1] + theta[b, 2] * x[2])
    if count[b] >= 8.0 and r * r > REJECT_SIGMAS ** 2 * noise[b] and rejects[b] < MAX_REJECTS:
        rejects[b] += 1
        return False
    rejects[b] = 0
    if count[b] < 1e-9:  # first step: the assumed noise, at this machine's scale
        noise[b] = (NOISE0 * y) ** 2
    elif count[b] >= 2.0:  # the first residuals only reflect the prior
        noise[b] = decay * noise[b] + (1.0 - decay) * min(r * r, 16.0 * noise[b])
        noise[b] = max(noise[b], (MIN_NOISE * theta[b, 0]) ** 2)
    count[b] = decay * count[b] + 1.0
    for i in range(3):
        xty[b, i] = decay * xty[b, i] + x[i] * y
        for j in range(3):
            xtx[b, i, j] = decay * xtx[b, i, j] + x[i] * x[j]
    prec = np.empty((3, 3))
    rhs = np.empty(3)
    a = theta[b, 0] if count[b] > 1.5 else y  # the scale the prior's spreads follow
    _posterior(b, xtx, xty, noise, prior_mean, prior_sd, a, prec, rhs)
    out = np.empty(3)
    _fit(prec, rhs, out)
    theta[b, 0], theta[b, 1], theta[b, 2] = out[0], out[1], out[2]
    return True


@kernel
def _contrast_sd(b, v, xtx, xty, noise, prior_mean, prior_sd, theta):
    """Posterior standard deviation of v . theta in bucket b."""
    prec = np.empty((3, 3))
    rhs = np.empty(3)
    _posterior(b, xtx, xty, noise, prior_mean, prior_sd, theta[b, 0], prec, rhs)
    out = np.empty(3)
    _solve(prec, v, np.ones(3, np.bool_), out)
    return math.sqrt(max(v[0] * out[0] + v[1] * out[1] + v[2] * out[2], 0.0))


def bucket_of(batch: int) -> int:
    return min(int(round(BUCKETS_PER_OCTAVE * math.log2(max(batch, 1)))), MAX_BUCKETS - 1)


class OnlineStepCosts:
    """T(B, m) for the draft budget, learned from timed steps on top of a prior model."""

    def __init__(self, prior: StepCostModel):
        kernel.compile()
        self.prior = prior
        nb = MAX_BUCKETS
        self._xtx = np.zeros((nb, 3, 3))
        self._xty = np.zeros((nb, 3))
        self._count = np.zeros(nb)
        self._noise = np.full(nb, NOISE0 ** 2)
        self._rejects = np.zeros(nb, np.int64)
        self._theta = np.tile(np.array([1.0, 0.0, 1.0]), (nb, 1))
        self._prior_mean = np.tile(np.array([1.0, 0.0, 1.0]), (nb, 1))  # a0, c1_0, c2/a
        self._prior_sd = np.array(PRIOR_SD)
        self._started = np.zeros(nb, bool)
        self._drafter = np.zeros(nb)      # drafter time / P(B), averaged
        self._drafter_n = np.zeros(nb)
        self._drafted = np.zeros(nb)      # draft tokens per row per step, averaged
        self._steps = np.zeros(nb, np.int64)  # budget decisions taken in the bucket
        self._observed = np.zeros(nb, np.int64)  # steps fitted in the bucket
        self._explored_at = np.full(nb, -1, np.int64)  # _observed at the last exploration
        self._increments: OrderedDict[int, tuple[float, np.ndarray]] = OrderedDict()
        self._x = np.empty(3)
        self.steps_observed = 0
        self.steps_rejected = 0   # outliers left out of the fit
        self.steps_explored = 0
        self.decisions = 0

    # -- the prior's shape -------------------------------------------------

    def _prior_at(self, batch: int, tokens: int) -> tuple[float, np.ndarray]:
        """P(B) and I(B, m) for m = 0..tokens (cached per batch size)."""
        hit = self._increments.get(batch)
        if hit is None or len(hit[1]) <= tokens:
            size = max(tokens, 16 * batch) + 1
            t = self.prior.step_ms(batch, 1.0 + np.arange(size) / batch)
            hit = (float(t[0]), t / t[0] - 1.0)
            self._increments[batch] = hit
            if len(self._increments) > 512:
                self._increments.popitem(last=False)
        return hit

    def _start(self, b: int) -> None:
        """A bucket's first use: borrow the fit of the nearest trained bucket."""
        self._started[b] = True
        trained = np.flatnonzero(self._count >= MIN_EFFECTIVE)
        if len(trained):
            near = trained[np.argmin(np.abs(trained - b))]
            a, c1, c2 = self._theta[near]
            self._prior_mean[b] = (a, c1, c2 / a if a > 0 else 1.0)
            self._theta[b] = self._theta[near]
            self._drafter[b] = self._drafter[near]
            self._drafter_n[b] = min(self._drafter_n[near], 1.0)

    # -- learning --------------------------------------------------------

    def observe(self, batch: int, drafted: int, step_ms: float, drafter_ms: float) -> bool:
        """One engine step of ``batch`` rows that verified ``drafted`` draft
        tokens took ``step_ms``; the drafter took ``drafter_ms`` before it.
        Returns False if the step was left out as an outlier."""
        if batch < 1 or drafted < 0 or not (step_ms > 0.0 and math.isfinite(step_ms)):
            return False
        b = bucket_of(batch)
        if not self._started[b]:
            self._start(b)
        base, inc = self._prior_at(batch, drafted)
        x = self._x
        x[0], x[1], x[2] = 1.0, drafted / batch, inc[drafted]
        ok = _observe(b, x, step_ms / base, self._xtx, self._xty, self._count, self._noise,
                      self._rejects, self._theta, self._prior_mean, self._prior_sd, DECAY)
        if ok:
            self.steps_observed += 1
            self._observed[b] += 1
            d, n = drafter_ms / base, self._drafter_n[b]
            if n >= 8 and d > 4 * self._drafter[b]:
                d = 4 * self._drafter[b]  # an eviction or a hiccup: counted, not believed
            self._drafter_n[b] = n = min(n + 1, 1.0 / (1.0 - DECAY))
            self._drafter[b] += (d - self._drafter[b]) / n
            self._drafted[b] += (drafted / batch - self._drafted[b]) / n
        else:
            self.steps_rejected += 1
        return ok

    # -- predicting ------------------------------------------------------

    def step_ms(self, batch: int, tokens: int, shade: float = 0.0,
                drafter: bool = True) -> np.ndarray:
        """Predicted step time (ms, the drafter's included unless ``drafter``
        is False) with 0..tokens draft tokens. ``shade`` scales the draft
        tokens' cost by ``1 + shade``."""
        b = bucket_of(batch)
        if not self._started[b]:
            self._start(b)
        base, inc = self._prior_at(batch, tokens)
        a, c1, c2 = self._theta[b]
        m = np.arange(tokens + 1)
        extra = c1 * m / batch + c2 * inc[:tokens + 1]
        fixed = max(a, 1e-3) + (self._drafter[b] if drafter else 0.0)
        return base * (fixed + max(1.0 + shade, 0.0) * np.maximum(extra, 0.0))

    def uncertainty(self, batch: int, of_step: bool = False) -> float:
        """Relative standard deviation of the cost of one more draft token
        per row, where the bucket has been drafting lately (``of_step``:
        relative to the step's time instead)."""
        b = bucket_of(batch)
        m = int(round(self._drafted[b] * batch))
        _, inc = self._prior_at(batch, m + batch)
        v = np.array([0.0, 1.0, inc[m + batch] - inc[m]])
        sd = _contrast_sd(b, v, self._xtx, self._xty, self._noise, self._prior_mean,
                          self._prior_sd, self._theta)
        a, c1, c2 = self._theta[b]
        if of_step:
            return sd / max(a, 1e-3)
        mean = c1 + c2 * v[2]
        return sd / max(abs(mean), 0.01 * max(a, 1e-3))

    def explore_shade(self, batch: int) -> float:
        """How far (relative) to shade the draft-token cost down if this step
        explores; 0 if it should not: only every EXPLORE_EVERY-th decision in
        a bucket, only while the cost is uncertain, and only once steps are
        being timed (an engine whose steps cannot be attributed learns
        nothing from exploring), and only while the uncertainty is worth a
        share of a step. The caller explores only if the bounds
        ``1 -/+ shade`` choose different drafts."""
        b = bucket_of(batch)
        self._steps[b] += 1
        self.decisions += 1
        if self._steps[b] % EXPLORE_EVERY != 1 or self._observed[b] == self._explored_at[b]:
            return 0.0
        sd = self.uncertainty(batch)
        if sd <= EXPLORE_ABOVE or self.uncertainty(batch, of_step=True) <= EXPLORE_STEP_SHARE:
            return 0.0
        self._explored_at[b] = self._observed[b]
        return min(2.0 * sd, 0.9)

    def summary(self, batch: int) -> dict:
        """What was learned at this batch size: ms per step with 0, 1 and 2
        draft tokens per row (drafter included), and the prior's."""
        if batch < 1:
            return {}
        t = self.step_ms(batch, 2 * batch)
        p = self.prior.step_ms(batch, np.array([1.0, 2.0, 3.0]))
        b = bucket_of(batch)
        return {"batch": batch, "ms_per_step": [round(float(t[i * batch]), 3) for i in range(3)],
                "prior_ms_per_step": [round(float(x), 3) for x in p],
                "drafter_ms": round(float(self._drafter[b] * self._prior_at(batch, 0)[0]), 3),
                "observed_in_bucket": round(float(self._count[b]), 1),
                "relative_sd": round(float(self.uncertainty(batch)), 3)}
