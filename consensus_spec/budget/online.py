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
PRIOR_SD_A, PRIOR_SD_C1, PRIOR_SD_C2 = 1.0, 1.0, 1.0  # prior spreads, in units of a
NOISE0 = 0.05           # relative noise assumed before any residual is seen
MIN_NOISE = 0.01        # relative: no machine times its steps better than this
REJECT_SIGMAS = 5.0     # residuals beyond this many sigmas are outliers...
MAX_REJECTS = 8         # ...unless this many come in a row (the level moved)
MIN_EFFECTIVE = 20.0    # observations before a bucket lends its fit to new ones
PRIOR_CACHE = 512       # batch sizes whose prior increments are kept (least recently made dropped)


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
def fit(prec, rhs, out):
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


# A bucket's state, one row of floats (few kernel arguments: cheap calls).
XTX, XTY, COUNT, NOISE, REJECTS, THETA, PRIOR, DRAFTER, DRAFTER_N, DRAFTED = 0, 9, 12, 13, 14, 15, 18, 21, 22, 23
OBSERVED, EXPLORED_AT = 24, 25
REF, MEASURED, WIDTH = 26, 29, 30  # a measured prior's fit and whether it still holds (measured.py)


@kernel
def posterior(state, b, scale, prec, rhs):
    """Precision matrix and right-hand side of bucket b's posterior. The
    prior on c2 is centred on r * a (r: the prior's third entry), and every
    prior spread is relative to the step's scale (a): the prior speaks in
    shares of a step, whatever the machine's speed."""
    s = state[b]
    s2 = s[NOISE]
    for i in range(3):
        rhs[i] = s[XTY + i] / s2
        for j in range(3):
            prec[i, j] = s[XTX + 3 * i + j] / s2
    scale = max(scale, 1e-3)
    pa = 1.0 / (PRIOR_SD_A * scale) ** 2
    p1 = 1.0 / (PRIOR_SD_C1 * scale) ** 2
    p2 = 1.0 / (PRIOR_SD_C2 * scale) ** 2
    a0, c10, r = s[PRIOR], s[PRIOR + 1], s[PRIOR + 2]
    prec[0, 0] += pa + p2 * r * r
    rhs[0] += pa * a0
    prec[1, 1] += p1
    rhs[1] += p1 * c10
    prec[2, 2] += p2
    prec[0, 2] -= p2 * r
    prec[2, 0] -= p2 * r


@kernel
def _predictive_var(state, b, x1, x2):
    """Variance of a new step's relative time at features (1, x1, x2): the
    noise plus the fit's own uncertainty there."""
    sd = contrast_sd(state, b, 1.0, x1, x2)
    return state[b, NOISE] + sd * sd


@kernel
def _observe(state, b, x1, x2, y, drafter, per_row):
    """Add one step (relative time y at features 1, x1, x2) to bucket b and
    refit; average the drafter's relative time and the drafts per row.
    Returns False for an outlier left out."""
    s = state[b]
    r = y - (s[THETA] + s[THETA + 1] * x1 + s[THETA + 2] * x2)
    # an outlier is judged against the prediction's whole spread: the noise
    # and what the fit does not know yet (a step with many more drafts than
    # those seen so far teaches the slope; it is no hiccup)
    if s[COUNT] >= 8.0 and r * r > REJECT_SIGMAS ** 2 * _predictive_var(state, b, x1, x2) \
            and s[REJECTS] < MAX_REJECTS:
        s[REJECTS] += 1
        return False
    s[REJECTS] = 0
    if s[COUNT] < 1e-9:  # first step: the assumed noise, at this machine's scale
        s[NOISE] = (NOISE0 * y) ** 2
    elif s[COUNT] >= 2.0:  # the first residuals only reflect the prior
        s[NOISE] = DECAY * s[NOISE] + (1.0 - DECAY) * min(r * r, 16.0 * s[NOISE])
        s[NOISE] = max(s[NOISE], (MIN_NOISE * s[THETA]) ** 2)
    s[COUNT] = DECAY * s[COUNT] + 1.0
    x = np.array([1.0, x1, x2])
    for i in range(3):
        s[XTY + i] = DECAY * s[XTY + i] + x[i] * y
        for j in range(3):
            s[XTX + 3 * i + j] = DECAY * s[XTX + 3 * i + j] + x[i] * x[j]
    prec = np.empty((3, 3))
    rhs = np.empty(3)
    posterior(state, b, s[THETA] if s[COUNT] > 1.5 else y, prec, rhs)
    out = np.empty(3)
    fit(prec, rhs, out)
    s[THETA], s[THETA + 1], s[THETA + 2] = out[0], out[1], out[2]
    # the drafter's time: an eviction or a hiccup is counted, not believed
    n = s[DRAFTER_N]
    if n >= 8.0 and drafter > 4.0 * s[DRAFTER]:
        drafter = 4.0 * s[DRAFTER]
    n = min(n + 1.0, 1.0 / (1.0 - DECAY))
    s[DRAFTER_N] = n
    s[DRAFTER] += (drafter - s[DRAFTER]) / n
    s[DRAFTED] += (per_row - s[DRAFTED]) / n
    s[OBSERVED] += 1.0
    return True


@kernel
def table(state, b, base, inc, batch, shade, drafter, out):
    """out[m]: predicted step time (ms) with m draft tokens."""
    s = state[b]
    a, c1, c2 = max(s[THETA], 1e-3), s[THETA + 1], s[THETA + 2]
    fixed = a + (s[DRAFTER] if drafter else 0.0)
    k = max(1.0 + shade, 0.0)
    for m in range(out.shape[0]):
        out[m] = base * (fixed + k * max(c1 * m / batch + c2 * inc[m], 0.0))


@kernel
def first_token_cost(state, b, inc, shade, batch):
    """Bucket b's cost of one draft token per step relative to the step
    without drafts (the drafter's time in both), its draft-token cost
    scaled by ``1 + shade``; ``inc``: the prior's increments at ``batch``."""
    a, c1, c2 = state[b, THETA], state[b, THETA + 1], state[b, THETA + 2]
    extra = max(1.0 + shade, 0.0) * max(c1 / batch + c2 * inc[1], 0.0)
    drafter = state[b, DRAFTER]
    return extra / (max(a, 1e-3) + drafter)


@kernel
def contrast_sd(state, b, v0, v1, v2):
    """Posterior standard deviation of (v0, v1, v2) . theta in bucket b."""
    prec = np.empty((3, 3))
    rhs = np.empty(3)
    posterior(state, b, state[b, THETA], prec, rhs)
    v = np.array([v0, v1, v2])
    out = np.empty(3)
    _solve(prec, v, np.ones(3, np.bool_), out)
    return math.sqrt(max(v[0] * out[0] + v[1] * out[1] + v[2] * out[2], 0.0))


_LOG2 = [0] + [min(int(round(BUCKETS_PER_OCTAVE * math.log2(n))), MAX_BUCKETS - 1)
               for n in range(1, 4097)]


_LOG2_N = len(_LOG2)
_NO_FIT = (-1, 0.0, np.zeros(0), 0)


def bucket_of(batch: int) -> int:
    if 0 <= batch < _LOG2_N:
        return _LOG2[batch]
    return min(int(round(BUCKETS_PER_OCTAVE * math.log2(max(batch, 1)))), MAX_BUCKETS - 1)


class OnlineStepCosts:
    """T(B, m) for the draft budget, learned from timed steps on top of a prior model."""

    def __init__(self, prior: StepCostModel):
        kernel.compile()
        self.prior = prior
        self._state = np.zeros((MAX_BUCKETS, WIDTH))
        self._state[:, NOISE] = NOISE0 ** 2
        self._state[:, THETA:THETA + 3] = (1.0, 0.0, 1.0)
        self._state[:, PRIOR:PRIOR + 3] = (1.0, 0.0, 1.0)  # a0, c1_0, c2 / a
        self._state[:, EXPLORED_AT] = -1.0
        self._increments: OrderedDict[int, tuple[float, np.ndarray]] = OrderedDict()
        self._last_fit = _NO_FIT  # fit_inputs' last answer (batch, base, inc, bucket)
        self._started = [False] * MAX_BUCKETS  # plain lists: read every step, cheaply
        self._steps = [0] * MAX_BUCKETS
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
            self._last_fit = _NO_FIT  # it may hold an entry replaced or dropped here
            if len(self._increments) > PRIOR_CACHE:
                self._increments.popitem(last=False)
        return hit

    @property
    def cached_batches(self) -> int:
        """Batch sizes whose prior increments are cached (at most ``PRIOR_CACHE``)."""
        return len(self._increments)

    def _bucket(self, batch: int) -> int:
        """The bucket of ``batch``; at its first use, it borrows the fit of
        the nearest trained bucket."""
        b = bucket_of(batch)
        if not self._started[b]:
            self._started[b] = True
            state = self._state
            trained = np.flatnonzero(state[:, COUNT] >= MIN_EFFECTIVE)
            if len(trained):
                near = state[trained[np.argmin(np.abs(trained - b))]]
                a, c1, c2 = near[THETA:THETA + 3]
                state[b, PRIOR:PRIOR + 3] = (a, c1, c2 / a if a > 0 else 1.0)
                state[b, THETA:THETA + 3] = near[THETA:THETA + 3]
                state[b, DRAFTER] = near[DRAFTER]
                state[b, DRAFTER_N] = min(near[DRAFTER_N], 1.0)
        return b

    # -- learning --------------------------------------------------------

    def observe(self, batch: int, drafted: int, step_ms: float, drafter_ms: float) -> bool:
        """One engine step of ``batch`` rows that verified ``drafted`` draft
        tokens took ``step_ms``; the drafter took ``drafter_ms`` before it.
        Returns False if the step was left out as an outlier."""
        if batch < 1 or drafted < 0 or not (step_ms > 0.0 and math.isfinite(step_ms)):
            return False
        _, b, base, inc = self.fit_inputs(batch, drafted)
        ok = _observe(self._state, b, drafted / batch, inc[drafted], step_ms / base,
                      max(drafter_ms, 0.0) / base, drafted / batch)
        if ok:
            self.steps_observed += 1
        else:
            self.steps_rejected += 1
        return ok

    # -- predicting ------------------------------------------------------

    def step_ms(self, batch: int, tokens: int, shade: float = 0.0,
                drafter: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        """Predicted step time (ms, the drafter's included unless ``drafter``
        is False) with 0..tokens draft tokens. ``shade`` scales the draft
        tokens' cost by ``1 + shade``. ``out``: an array to fill (its length
        decides the tokens)."""
        b = self._bucket(batch)
        if out is None:
            out = np.empty(tokens + 1)
        base, inc = self._prior_at(batch, len(out) - 1)
        table(self._state, b, base, inc, batch, shade, drafter, out)
        return out

    def uncertainty(self, batch: int) -> tuple[float, float]:
        """Standard deviation of the cost of one more draft token per row,
        where the bucket has been drafting lately: relative to that cost,
        and relative to the step's time."""
        b = self._bucket(batch)
        s = self._state[b]
        m = int(round(s[DRAFTED] * batch))
        _, inc = self._prior_at(batch, m + batch)
        v2 = inc[m + batch] - inc[m]
        sd = contrast_sd(self._state, b, 0.0, 1.0, v2)
        a = max(s[THETA], 1e-3)
        return sd / max(abs(s[THETA + 1] + s[THETA + 2] * v2), 0.01 * a), sd / a

    def explore_shade(self, batch: int) -> float:
        """How far (relative) to shade the draft-token cost down if this step
        explores; 0 if it should not: only every EXPLORE_EVERY-th decision in
        a bucket, only while the cost is uncertain, only once steps are
        being timed (an engine whose steps cannot be attributed learns
        nothing from exploring), and only while the uncertainty is worth a
        share of a step. The caller explores only if the bounds
        ``1 -/+ shade`` choose different drafts."""
        return self._explore_shade(batch, self._bucket(batch))

    def _explore_shade(self, batch: int, b: int) -> float:
        """:meth:`explore_shade` in bucket ``b``, that of ``batch``."""
        self._steps[b] += 1
        self.decisions += 1
        if self._steps[b] % EXPLORE_EVERY != 1:
            return 0.0
        s = self._state[b]
        if s.item(OBSERVED) == s.item(EXPLORED_AT):
            return 0.0
        relative, of_step = self.uncertainty(batch)
        if relative <= EXPLORE_ABOVE or of_step <= EXPLORE_STEP_SHARE:
            return 0.0
        s[EXPLORED_AT] = s[OBSERVED]
        return min(relative, 0.5)  # one sd: a contrast cheap enough for the budget's loss cap

    def fit_inputs(self, batch: int, tokens: int) -> tuple:
        """What a kernel needs to build :meth:`step_ms`'s table for up to
        ``tokens`` draft tokens itself (``table``) or the cost of a first
        draft token (``first_token_cost``): the state, the bucket of
        ``batch``, the prior's one-token step and its increments."""
        last = self._last_fit  # the common call: the batch size of the call before
        if last[0] == batch and len(last[2]) > tokens:
            return self._state, last[3], last[1], last[2]
        b = self._bucket(batch)
        base, inc = self._prior_at(batch, tokens)
        self._last_fit = (batch, base, inc, b)
        return self._state, b, base, inc

    def summary(self, batch: int) -> dict:
        """What was learned at this batch size: ms per step with 0, 1 and 2
        draft tokens per row (drafter included), and the prior's."""
        if batch < 1:
            return {}
        t = self.step_ms(batch, 2 * batch)
        p = self.prior.step_ms(batch, np.array([1.0, 2.0, 3.0]))
        s = self._state[bucket_of(batch)]
        return {"batch": batch, "ms_per_step": [round(float(t[i * batch]), 3) for i in range(3)],
                "prior_ms_per_step": [round(float(x), 3) for x in p],
                "drafter_ms": round(float(s[DRAFTER] * self._prior_at(batch, 0)[0]), 3),
                "observed_in_bucket": round(float(s[COUNT]), 1),
                "relative_sd": round(float(self.uncertainty(batch)[0]), 3)}

    def learned(self) -> list[dict]:
        """:meth:`summary` at each power-of-two batch size whose bucket has
        timed steps."""
        return [self.summary(b) for b in (1 << i for i in range(13))
                if self._state[bucket_of(b), COUNT] > 0]
