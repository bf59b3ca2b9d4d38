"""The draft-length policy: per row, how many draft tokens pay at this batch
size, greedily and most likely first, under a step-cost model."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..jit import Kernels
from . import calibration, online
from .calibration import AcceptanceCalibrator, bin_of, calibrate, lowest_estimate_above  # noqa: F401
from .cost_models import StepCostModel
from .guard import DraftingGuard
from .measured import MeasuredStepCosts
from .online import first_token_cost, table  # noqa: F401  (bound compiled)

kernel = Kernels(globals(), uses=(calibration.kernel, online.kernel))


@kernel
def _levels(rate, level_of, value):
    """The calibrated chances a draft token can have, ``min(1, rate[b])``,
    as levels, highest first (equal ones one level): ``level_of[b]`` is
    bin b's level and ``value[level]`` its chance. Returns the levels."""
    bins = rate.shape[0]
    order = np.empty(bins, np.int64)
    for b in range(bins):  # insertion sort, high first: a score of bins
        x = min(1.0, rate[b])
        c = b
        while c > 0 and min(1.0, rate[order[c - 1]]) < x:
            order[c] = order[c - 1]
            c -= 1
        order[c] = b
    n = 0
    for a in range(bins):
        x = min(1.0, rate[order[a]])
        if n == 0 or x != value[n - 1]:
            value[n] = x
            n += 1
        level_of[order[a]] = n - 1
    return n


@kernel
def _ranked(probs, lengths, rate, chance, row):
    """Every draft token a choice may keep, most likely first: token t of
    the result is row ``row[t]``'s next one, whose calibrated chance with
    the tokens before it in its draft is ``chance[t]`` (at most 1, never
    rising along a draft); ties go to the lower row, then to the earlier
    token. Returns the order (indices into ``chance`` and ``row``)."""
    k = probs.shape[1]
    n = 0
    for i in range(probs.shape[0]):
        if min(lengths[i], k) > 0:
            n += min(lengths[i], k)
    bins = rate.shape[0]
    if bins == 0:  # uncalibrated: any chance; a stable sort keeps rows and positions in order
        t = 0
        for i in range(probs.shape[0]):
            low = 1.0
            for j in range(min(lengths[i], k)):
                low = min(low, probs[i, j])
                chance[t], row[t] = low, i
                t += 1
        return np.argsort(-chance[:n], kind="mergesort")
    # calibrated: a score of distinct chances, so a counting sort by level
    level_of = np.empty(bins, np.int64)
    value = np.empty(bins)
    _levels(rate, level_of, value)
    level = np.empty(n, np.int64)
    count = np.zeros(bins + 1, np.int64)
    t = 0
    for i in range(probs.shape[0]):
        low = 0  # the draft's lowest chance so far, as a level (higher: less likely)
        for j in range(min(lengths[i], k)):
            low = max(low, level_of[bin_of(probs[i, j], bins)])
            level[t], row[t], chance[t] = low, i, value[low]
            count[low + 1] += 1
            t += 1
    for b in range(bins):
        count[b + 1] += count[b]
    order = np.empty(n, np.int64)
    for t in range(n):
        order[count[level[t]]] = t
        count[level[t]] += 1
    return order


@kernel
def _choose(probs, lengths, batch, step_ms, rate, out):
    """Greedy: keep the most likely remaining draft token while that raises
    (batch + kept probability) / step time, ``step_ms[m]`` with m kept. The
    ratio of a concave gain to a convex cost is unimodal in m, so the first
    drop is final.

    Returns the choice's slack: a draft token the walk did not reach whose
    calibrated chance is below it changes nothing (it comes after every
    kept token and fails where the greedy stopped); -inf when the table
    ends there."""
    out[:] = 0
    if batch <= 0:
        return -np.inf
    chance = np.empty(probs.size)
    row = np.empty(probs.size, np.int64)
    order = _ranked(probs, lengths, rate, chance, row)
    gain = float(batch)
    best = gain / step_ms[0]
    kept = 0
    last = np.inf  # the last kept token's chance
    for t in order:
        if kept + 1 >= step_ms.shape[0]:
            break
        r = (gain + chance[t]) / step_ms[kept + 1]
        if r <= best:
            break
        kept += 1
        best, gain, last = r, gain + chance[t], chance[t]
        out[row[t]] += 1
    if kept + 1 >= step_ms.shape[0]:
        return -np.inf
    return min(last, best * step_ms[kept + 1] - gain)


@kernel
def _value(probs, chosen, batch, step_ms, rate):
    """Expected tokens per ms of ``chosen`` draft lengths: (batch + kept
    calibrated chances) / step_ms[kept], as :func:`_choose` scores them."""
    gain = float(batch)
    kept = 0
    for i in range(chosen.shape[0]):
        low = 1.0
        for j in range(chosen[i]):
            low = min(low, min(1.0, calibrate(probs[i, j], rate)))
            gain += low
            kept += 1
    return gain / step_ms[min(kept, step_ms.shape[0] - 1)]


@kernel
def _most_kept(lengths, k):
    """The most draft tokens a choice can keep: the sum of min(length, k)."""
    n = 0
    for i in range(lengths.shape[0]):
        n += min(lengths[i], k)
    return n


# A walk need not reach what the choice will not keep. An ordinary step's
# floor rises to the lowest estimate whose rate beats a share of the last
# choice's slack at its batch size (see _choose); the choice checks it and
# says to walk again at the safe floor if the raised one cut too much. The
# share falls after each such walk and creeps back after each that was not
# (about one raised step in 40 walks twice).
SHARE_START, SHARE_MIN, SHARE_DOWN, SHARE_UP = 0.8, 0.05, 0.7, 1.01


@kernel
def _raise(hits, trials, slack, batch, safe):
    """(the floor, the chance it was raised for or 0): ``safe`` raised to
    the lowest estimate whose rate beats ``slack[batch]``'s share of its
    slack (the chance it was raised for), if that is higher."""
    if slack[batch, 0] <= 0.0:
        return safe, 0.0
    x = slack[batch, 0] * slack[batch, 1]
    floor = lowest_estimate_above(hits, trials, x)
    if floor > safe:
        return floor, x
    return safe, 0.0


@kernel
def _settle(slack, batch, raised, s):
    """After a choice of slack ``s`` on walks whose floor was raised for
    the chance ``raised`` (0: not raised): whether they must be walked
    again at the safe floor (the tokens it cut have chances at most
    ``raised``: the same choice if that is under the slack);
    ``slack[batch]`` learns from it."""
    again = raised > 0.0 and not raised < s * (1.0 - 1e-9)
    if again:
        slack[batch, 1] = max(SHARE_MIN, slack[batch, 1] * SHARE_DOWN)
    else:
        slack[batch, 0] = s
        if raised > 0.0:
            slack[batch, 1] = min(SHARE_START, slack[batch, 1] * SHARE_UP)
    return again


@kernel
def _floor_for_cost(hits, trials, cost, slack, batch):
    """An ordinary step's floor, ``cost`` the rate a first draft token must
    beat: (the floor, the safe floor, the chance it was raised for or 0).
    The safe floor is the lowest estimate whose calibrated rate beats
    ``cost``; it may be raised (:func:`_raise`)."""
    safe = lowest_estimate_above(hits, trials, cost)
    floor, x = _raise(hits, trials, slack, batch, safe)
    return floor, safe, x


@kernel
def _choose_settled(probs, lengths, batch, step_ms, rate, out, slack, raised):
    """:func:`_choose`, then :func:`_settle`: whether to walk again."""
    return _settle(slack, batch, raised, _choose(probs, lengths, batch, step_ms, rate, out))


@kernel
def _floor_on_fit(state, b, inc, shade, batch, hits, trials, slack):
    """:meth:`DraftBudget.floor` with learned costs, as
    :func:`_floor_for_cost` with the first draft token's cost; an exploring
    step's (``shade`` != 0) is never raised."""
    cost = batch * first_token_cost(state, b, inc, shade, batch)
    if shade != 0.0:
        safe = lowest_estimate_above(hits, trials, cost)
        return safe, safe, 0.0
    return _floor_for_cost(hits, trials, cost, slack, batch)


@kernel
def _choose_on_fit(probs, lengths, batch, state, b, base, inc, hits, trials, out, scratch, rate,
                   slack, raised):
    """:func:`_choose` on the step times a fit gives (``table``, the
    drafter's time in, no shade) with the rates ``hits / trials``: an
    ordinary step of :meth:`DraftBudget.__call__` in one call (``scratch``
    and ``rate``: scratch). ``raised``: the chance the walks' floor was
    raised for (0: not raised). Returns the most tokens it could keep (< 0:
    nothing done) and whether the walks must be made again (:func:`_settle`)."""
    tokens = _most_kept(lengths, probs.shape[1])
    if tokens < 0 or tokens >= scratch.shape[0] or tokens >= inc.shape[0]:
        return -1, raised > 0.0
    for i in range(hits.shape[0]):
        rate[i] = hits[i] / trials[i]
    # one entry past the most it can keep: the slack of keeping them all
    step_ms = scratch[:min(tokens + 2, scratch.shape[0], inc.shape[0])]
    table(state, b, base, inc, batch, 0.0, True, step_ms)
    return tokens, _choose_settled(probs, lengths, batch, step_ms, rate, out, slack, raised)


EXPLORE_LOSS = 0.01  # an exploring step may cost at most this share of its expected yield

_NO_CALIBRATION = np.zeros(0)


def choose_lengths(probs: np.ndarray, lengths: np.ndarray, batch: int,
                   model: StepCostModel, calibrator: "AcceptanceCalibrator | None" = None
                   ) -> np.ndarray:
    """Per-row draft lengths maximising expected tokens per step time.

    ``probs[i, j]`` (an R x k array; entries ``j >= lengths[i]`` are ignored)
    is the chance that row i's first j+1 draft tokens are all accepted,
    non-increasing in j; a ``calibrator`` first maps it to observed rates.
    ``batch`` counts every row in the step, drafting or not. Returns lengths
    no longer than ``lengths``.
    """
    kernel.compile()
    probs = np.asarray(probs, dtype=np.float64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if probs.ndim != 2:
        probs = probs.reshape(len(lengths), -1)
    out = np.zeros(len(lengths), np.int64)
    if batch <= 0:
        return out
    step_ms = model.step_ms(batch, 1.0 + np.arange(probs.size + 1) / batch)
    rate = _NO_CALIBRATION if calibrator is None else calibrator.rate()
    _choose(probs, lengths, int(batch), step_ms, rate, out)
    return out


STEP_CACHE = 256  # batch sizes whose step times the budget keeps (least recently made dropped)


class DraftBudget:
    """The budget as a proposer applies it each step: a cost model (fixed,
    or learned online on top of it as a prior), step times cached per batch
    size, and a calibrator learning from what the verifier accepted.

    Per step: :meth:`floor` (which also decides whether this step explores
    the cost of draft tokens), then the call that keeps draft lengths (once
    more on walks made again at ``safe_floor`` if it set ``redraft``), then
    :meth:`observe` and, with online costs, :meth:`observe_step`."""

    def __init__(self, model: StepCostModel, calibrator: "AcceptanceCalibrator | None" = None,
                 online: bool = False, measured: list[dict] | None = None,
                 drafting_off_at: tuple[int, ...] = ()):
        """``measured``: a table timed on this machine (see measured.py) the
        online fit starts from; ``drafting_off_at``: batch sizes where a
        remembered guard verdict starts with drafting off."""
        kernel.compile()
        self.model = model
        self.calibrator = calibrator or AcceptanceCalibrator()
        self.costs = MeasuredStepCosts(model) if online else None
        if self.costs is not None and measured:
            self.costs.seed(measured)
        # self.costs may be swapped for a kept one (the proposer's reset): look it up each time
        self.guard = DraftingGuard(lambda b: self.costs.settled(b)) if online else None
        for batch in drafting_off_at if self.guard is not None else ():
            self.guard.start_off(batch)
        self.tokens_explore_lost = 0.0  # what exploring steps were expected to give up
        self.tokens_seen, self.seconds_seen = 0, 0.0  # every step the guard saw
        self._draft = True  # this step may carry drafts (the guard's call)
        self._step_ms: OrderedDict[int, np.ndarray] = OrderedDict()  # batch -> T(batch, 1 + m/batch)
        self._explore = False  # this step explores (see floor)
        self._shade = 0.0
        self._table = np.empty(0)  # scratch of ordinary steps (_choose_on_fit)
        self._rate = np.empty(self.calibrator.bins)
        # per batch size (as many rows as the engine has): the last choice's
        # slack and the share of it a raised floor takes (_floor_on_fit)
        self._slack = np.zeros((0, 2))
        self._raised = 0.0  # the chance this step's floor was raised for (0: not raised)
        self.safe_floor = 0.0
        self.redraft = False
        self.steps_raised, self.redrafts = 0, 0

    @property
    def drafter_off(self) -> bool:
        """The step :meth:`floor` just decided carries no drafts by the guard's
        policy (not a window): the proposer need not run its drafter."""
        return self.guard is not None and self.guard.off

    @property
    def plain_step(self) -> bool:
        """The step :meth:`floor` just decided carries no drafts (the guard's call)."""
        return not self._draft

    @property
    def cached_batches(self) -> int:
        """Batch sizes whose step times are cached here and in the online costs."""
        return len(self._step_ms) + (self.costs.cached_batches if self.costs is not None else 0)

    def step_ms(self, batch: int, kept: int) -> np.ndarray:
        """Step times with 0..kept draft tokens in a batch of ``batch`` rows."""
        if self.costs is not None:
            return self.costs.step_ms(batch, kept)
        table = self._step_ms.get(batch)
        if table is None or len(table) <= kept:
            table = self.model.step_ms(batch, 1.0 + np.arange(max(kept, 16 * batch) + 1) / batch)
            self._step_ms[batch] = table
            if len(self._step_ms) > STEP_CACHE:
                self._step_ms.popitem(last=False)
        return table

    def floor(self, batch: int) -> float:
        """Estimates below this cannot pay at this batch size, so the drafter
        need not walk past them: no calibrated chance at or below the first
        token's marginal cost is ever kept (the greedy's threshold only
        rises), and every estimate below the returned value calibrates to
        less than that cost. Call once per step, before drafting: it also
        decides whether the step explores (then the floor is the lower
        bound's, which lets either bound's drafts through). An ordinary
        step's floor may be raised above that safe one
        (``safe_floor``) from the last choice at this batch size; the call
        that keeps lengths then sets ``redraft`` if the walks must be made
        again at ``safe_floor`` for the same choice."""
        guard, costs = self.guard, self.costs
        self._draft = guard is None or guard.drafts(batch)
        if not self._draft:
            self._explore, self._raised = False, 0.0
            return 1.0  # no estimate reaches it: the drafter walks nothing
        if batch >= len(self._slack):
            grown = np.zeros((2 * batch + 1, 2))
            grown[:, 1] = SHARE_START
            grown[:len(self._slack)] = self._slack
            self._slack = grown
        hits, trials = self.calibrator.counts()
        if costs is None:
            t = self.step_ms(batch, 1)
            floor, self.safe_floor, self._raised = _floor_for_cost(
                hits, trials, batch * (t[1] - t[0]) / t[0], self._slack, batch)
        else:
            self._shade = shade = costs.explore_shade(batch)
            self._explore = shade > 0.0
            state, b, _, inc = costs.fit_inputs(batch, 1)
            floor, self.safe_floor, self._raised = _floor_on_fit(state, b, inc, -shade, batch, hits,
                                                                trials, self._slack)
        self.steps_raised += self._raised > 0.0
        return floor

    def __call__(self, probs: np.ndarray, lengths: np.ndarray, batch: int) -> np.ndarray:
        """:func:`choose_lengths` with this budget's model and calibration;
        on an exploring step, a bound's choice where the bounds differ."""
        out = np.empty(len(lengths), np.int64)
        raised, self._raised, self.redraft = self._raised, 0.0, False
        if not self._draft:
            out[:] = 0
            return out
        costs = self.costs
        if costs is not None and not self._explore and probs.ndim == 2:  # an ordinary step
            most = len(lengths) * probs.shape[1]
            state, b, base, inc = costs.fit_inputs(batch, most)
            if len(self._table) <= most:
                self._table = np.empty(2 * most + 2)
            hits, trials = self.calibrator.counts()
            tokens, self.redraft = _choose_on_fit(probs, lengths, batch, state, b, base, inc, hits,
                                                  trials, out, self._table, self._rate,
                                                  self._slack, raised)
            if tokens >= 0:
                self.redrafts += self.redraft
                return out
        if raised > 0.0 and costs is not None:  # no ordinary choice (probs not 2-D): walk again
            self.redraft = True
            self.redrafts += 1
            out[:] = 0
            return out
        rate = self.calibrator.rate()
        tokens = int(_most_kept(lengths, probs.shape[1] if probs.ndim == 2 else 0))
        if costs is None:  # a fixed cost model: the same check as an ordinary step's
            self.redraft = bool(_choose_settled(probs, lengths, batch, self.step_ms(batch, tokens + 1),
                                                rate, out, self._slack, raised))
            self.redrafts += self.redraft
            return out
        _choose(probs, lengths, batch, self.step_ms(batch, tokens), rate, out)
        if self._explore:
            self._explore = False
            low = np.empty_like(out)
            _choose(probs, lengths, batch, self.costs.step_ms(batch, tokens, -self._shade), rate, low)
            high = np.empty_like(out)
            _choose(probs, lengths, batch, self.costs.step_ms(batch, tokens, self._shade), rate, high)
            if low.sum() != high.sum():
                # the bound that differs from the estimate's choice, alternating
                # between them: drafts on both sides of it teach the slope...
                first, second = (low, high) if self.costs.steps_explored % 2 == 0 else (high, low)
                bound = first if first.sum() != out.sum() else second
                if self.costs.probing:  # a probe asks what a first draft token costs, on a
                    np.minimum(bound, 1, out=bound)  # quarter of the rows: enough to see it
                    bound[np.flatnonzero(bound)[max(len(bound) // 4, 1):]] = 0
                # ...where the estimate says that costs next to nothing
                table = self.step_ms(batch, tokens)
                v_bound = _value(probs, bound, batch, table, rate)
                v_out = _value(probs, out, batch, table, rate)
                # a probe's loss is bounded by its rarity, not per step
                if self.costs.probing or v_bound >= (1.0 - EXPLORE_LOSS) * v_out:
                    self.costs.steps_explored += not self.costs.probing
                    # tokens per ms short of the estimate's choice, over the step's time
                    self.tokens_explore_lost += float((v_out - v_bound) * table[min(int(bound.sum()),
                                                                                   len(table) - 1)])
                    return bound
        return out

    def observe(self, probs: np.ndarray, sent: np.ndarray, accepted: np.ndarray) -> None:
        self.calibrator.observe(probs, sent, accepted)

    def observe_step(self, batch: int, drafted: int, step_ms: float, drafter_ms: float) -> None:
        """A clean timed engine step (see :meth:`OnlineStepCosts.observe`);
        no-op without online costs."""
        if self.costs is not None:
            self.costs.observe(batch, drafted, step_ms, drafter_ms)

    def observe_throughput(self, tokens: int, seconds: float) -> None:
        """What the last step delivered, every step counted (the guard's input)."""
        if self.guard is not None:
            self.guard.observe(tokens, seconds)
            if seconds > 0.0 and tokens > 0:
                self.tokens_seen += tokens
                self.seconds_seen += seconds

    def learning_cost(self) -> dict:
        """What learning the step costs cost so far: the guard's forced plain
        steps, explored steps, and the tokens per second they gave up
        (estimated: windows against the steps before them, exploration by
        the fit's own values), as a share of the tokens delivered too."""
        if self.costs is None:
            return {}
        lost = self.guard.tokens_given_up + self.tokens_explore_lost
        return {"forced_plain_steps": self.guard.steps_forced_plain,
                "explored_steps": self.costs.steps_explored, "probed_steps": self.costs.steps_probed,
                "windows_skipped": self.guard.windows_skipped,
                "tokens_given_up": round(lost, 1),
                "tokens_per_s_given_up": round(lost / self.seconds_seen, 2) if self.seconds_seen else 0.0,
                "share_given_up": round(lost / self.tokens_seen, 4) if self.tokens_seen else 0.0,
                "measured_buckets": self.costs.measured_buckets(),
                "disagreements": self.costs.disagreements, "resettled": self.costs.resettled}
