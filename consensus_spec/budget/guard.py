"""A throughput check on the whole budget: does drafting pay, here, now?

The step-cost fit learns from clean steps only. On a busy engine most steps
also prefill arriving requests, and what drafts cost there (and anywhere the
engine spends time the fit does not see) reaches no model. So, per bucket of
batch sizes, the guard compares what both policies deliver in tokens per
measured second, every step counted: now and then a short window of steps
runs the other way (no drafts while drafting is on, the budget's drafts while
it is off), and each window is paired with the steps just before it, which
share its load. When the paired ratio says the other way is faster by more
than a margin, beyond what the windows' own scatter could explain, the
guard switches: on a shared machine a stall of a few steps now and then
falls on a window or on the steps it is paired with, so one window's ratio
is clipped and weighed against how much the windows disagree. Windows grow
rarer while the verdict holds, so a settled engine pays little for the check.
Where a measured step-cost table holds (``settled``, see measured.py) and
drafting is on, windows come only every ``MAX_PERIOD`` steps until one
disagrees: the table already says what drafts cost the engine, but not
whether drafting pays for the drafter's own time, which a table a server
remembered from another load (or another machine's neighbours) may not.

The plain side is plain without the drafter: where the guard's policy is no
drafts (``off``, outside a window) the proposer skips the drafter as well,
and a plain window step is charged no host time, as a plain engine's step.
So drafting must pay for its drafter's time to stay on, and where it
cannot the engine runs at about its speed without speculation.
"""

from __future__ import annotations

import math

WINDOW = 4            # steps in a window of the other policy
FIRST_PERIOD = 24     # steps between windows at first...
MAX_PERIOD = 384      # ...growing to this while the verdict holds
MARGIN = 0.03         # log-throughput advantage needed to switch (about 3%)
MIN_WINDOWS = 3       # paired windows before any switch
CLEAR = 4.0           # a verdict this many margins past it (beyond its error) is clear after 2
MEMORY = 0.7          # weight of past windows in the running verdict
CLIP = 0.7            # one window's log ratio counts at most this (2x): a stall is not a policy
SIGMAS = 2.0          # the verdict must pass the margin by this many of its standard errors
N_EFFECTIVE = (1 + MEMORY) / (1 - MEMORY)  # windows' worth of evidence in the running verdict
BUCKETS_PER_OCTAVE = 2


def _bucket(batch: int) -> int:
    if 0 <= batch < len(_BUCKETS):
        return _BUCKETS[batch]
    return int(round(BUCKETS_PER_OCTAVE * math.log2(max(batch, 1))))


_BUCKETS: list[int] = []
_BUCKETS += [_bucket(n) for n in range(4097)]  # looked up every step
_NUM_BUCKETS = len(_BUCKETS)


class _Bucket:
    __slots__ = ("drafting", "period", "countdown", "left", "window", "before", "verdict",
                 "scatter", "worst", "windows", "switches", "skipped")

    def __init__(self):
        self.drafting = True     # the policy most steps follow
        self.period = FIRST_PERIOD
        self.countdown = FIRST_PERIOD  # steps until the next window
        self.left = 0            # steps left in the current window
        self.window = [0.0, 0.0]  # tokens, seconds in the window
        self.before = []         # (tokens, seconds) of the latest ordinary steps
        self.verdict = 0.0       # running log(throughput other / throughput ordinary)
        self.scatter = 0.0       # running mean square of windows' ratios about the verdict
        self.worst = 0.0         # the highest window ratio since the last switch
        self.windows = 0
        self.switches = 0
        self.skipped = 0         # steps of due windows put off since the last one (settled)


class DraftingGuard:
    """Per batch-size bucket: whether this step drafts (:meth:`drafts`), and
    what each step delivered (:meth:`observe`, for the step just run)."""

    def __init__(self, settled=None):
        self._settled = settled  # batch -> True where a measured table holds (rare windows there)
        self._buckets: dict[int, _Bucket] = {}
        self._last: tuple[_Bucket, bool] | None = None  # bucket, was a window step
        self.windows = 0
        self.switches = 0
        self.steps_other = 0  # steps run against the current policy, to check it
        self.steps_forced_plain = 0  # of those, plain steps while drafting was the policy
        self.windows_skipped = 0     # due windows put off where a measured table holds
        self.tokens_given_up = 0.0   # windows' tokens short of the steps before them, summed
        self.off = False  # the last decision: no drafts by policy (not a window), so no drafter

    def drafts(self, batch: int) -> bool:
        """Whether the step about to be drafted for should carry drafts."""
        key = _BUCKETS[batch] if 0 <= batch < _NUM_BUCKETS else _bucket(batch)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket()
        if b.left == 0:
            b.countdown -= 1
            if b.countdown <= 0:
                if (b.drafting and b.worst <= MARGIN and b.skipped + b.period < MAX_PERIOD
                        and self._settled is not None and self._settled(batch)):
                    # a measured table holds: a window once MAX_PERIOD steps have passed
                    # (asked again each period, so a table the engine stops agreeing with,
                    # or a window against drafting, brings the usual schedule back)
                    b.skipped += b.period
                    b.countdown = b.period
                    self.windows_skipped += 1
                else:
                    b.skipped = 0
                    b.left, b.window = WINDOW, [0.0, 0.0]
        in_window = b.left > 0
        if in_window:
            b.left -= 1
            self.steps_other += 1
            self.steps_forced_plain += b.drafting
        self._last = (b, in_window)
        self.off = not b.drafting and not in_window
        return b.drafting != in_window

    def observe(self, tokens: int, seconds: float) -> None:
        """The step decided by the last :meth:`drafts` produced ``tokens``
        in ``seconds`` (engine and drafter)."""
        if self._last is None or not (seconds > 0.0) or tokens <= 0:
            return
        b, in_window = self._last
        self._last = None
        if not in_window:
            b.before.append((tokens, seconds))
            del b.before[:-WINDOW]
            return
        b.window[0] += tokens
        b.window[1] += seconds
        if b.left == 0 and len(b.before) == WINDOW:  # window done: pair it with the steps before
            ordinary = sum(t for t, _ in b.before) / sum(s for _, s in b.before)
            ratio = math.log((b.window[0] / b.window[1]) / ordinary)
            self.tokens_given_up += ordinary * b.window[1] - b.window[0]  # < 0: the window did better
            ratio = min(max(ratio, -CLIP), CLIP)
            b.worst = ratio if b.windows == 0 else max(b.worst, ratio)
            if b.windows == 0:
                b.verdict, b.scatter = ratio, 0.0
            else:
                b.scatter = MEMORY * b.scatter + (1 - MEMORY) * (ratio - b.verdict) ** 2
                b.verdict = MEMORY * b.verdict + (1 - MEMORY) * ratio
            b.windows += 1
            self.windows += 1
            error = SIGMAS * math.sqrt(b.scatter / min(b.windows, N_EFFECTIVE))
            if b.windows >= MIN_WINDOWS and b.verdict - error > MARGIN:
                b.drafting = not b.drafting  # the other policy delivers more
                b.switches += 1
                self.switches += 1
                b.verdict, b.scatter, b.windows, b.period = 0.0, 0.0, 0, FIRST_PERIOD
            elif b.drafting and b.windows >= 2 and max(b.worst, b.verdict + error) < -CLEAR * MARGIN:
                # drafting wins by far more than the margin in every window: a plain
                # window gives up about that much, and a short run would spend a
                # tenth of its steps on windows before MIN_WINDOWS
                b.period = min(4 * b.period, MAX_PERIOD)
            elif b.windows >= MIN_WINDOWS and b.verdict + error < -MARGIN:
                b.period = min(2 * b.period, MAX_PERIOD)  # settled: check less often
            elif ratio > MARGIN:
                b.period = max(b.period // 2, FIRST_PERIOD)  # a window against the verdict: look sooner
            b.countdown = b.period
            b.before = []
        elif b.left == 0:
            b.countdown = b.period  # nothing to pair it with: just wait for the next

    def start_off(self, batch: int) -> None:
        """Start the bucket of ``batch`` with drafting off (a remembered verdict)."""
        b = self._buckets.setdefault(_bucket(batch), _Bucket())
        b.drafting = False

    def summary(self) -> dict:
        return {"windows": self.windows, "switches": self.switches,
                "steps_other_policy": self.steps_other, "windows_skipped": self.windows_skipped,
                "drafting_off_at_rows": sorted(int(round(2 ** (k / BUCKETS_PER_OCTAVE)))
                                               for k, b in self._buckets.items() if not b.drafting)}
