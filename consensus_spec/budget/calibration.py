"""Acceptance calibration: the drafter's estimates come from few sightings
and run high, so they are mapped to the acceptance rate this engine has
observed, per bin of estimate."""

from __future__ import annotations

import numpy as np

from ..jit import Kernels

kernel = Kernels(globals())

_ndarray = np.ndarray
_F64, _I64 = np.dtype(np.float64), np.dtype(np.int64)  # numpy's native dtype objects
MIN_WEIGHT = 1e-9  # a bin's trials below which it keeps its rate instead of decaying


@kernel
def bin_of(p, bins):
    """Calibration bin of an estimate (clamped to [0, 1])."""
    return min(max(int(p * bins), 0), bins - 1)


@kernel
def calibrate(p, rate):
    """The observed acceptance rate of estimate ``p``'s bin (``p`` itself
    when ``rate`` has no bins)."""
    if rate.shape[0] == 0:
        return p
    return rate[bin_of(p, rate.shape[0])]


@kernel
def _first_bin_above(hits, trials, rate):
    for b in range(hits.shape[0]):
        if hits[b] > rate * trials[b]:
            return b
    return hits.shape[0]


@kernel
def lowest_estimate_above(hits, trials, rate):
    """An estimate below which every bin's observed rate is at most ``rate``."""
    return max(0.0, (_first_bin_above(hits, trials, rate) - 1e-6) / hits.shape[0])


@kernel
def _calibrated(probs, rate, out):
    for i in range(probs.shape[0]):
        low = 1.0
        for j in range(probs.shape[1]):
            low = min(low, calibrate(probs[i, j], rate))
            out[i, j] = low


@kernel
def _observe(probs, sent, accepted, hits, trials, decay):
    bins = hits.shape[0]
    any_sent = False
    for i in range(sent.shape[0]):
        any_sent = any_sent or sent[i] > 0
    if not any_sent:
        return
    for b in range(bins):
        # a bin nothing lands in stops decaying while its weight is still a
        # normal float: decayed into the denormals its hits and trials round
        # to the same few bits (0.025 read as 1.0 after ~150,000 sending steps)
        if trials[b] > MIN_WEIGHT:
            hits[b] *= decay
            trials[b] *= decay
    for i in range(probs.shape[0]):
        for j in range(min(sent[i], probs.shape[1])):
            b = bin_of(probs[i, j], bins)
            trials[b] += 1.0
            if j < accepted[i]:
                hits[b] += 1.0


class AcceptanceCalibrator:
    """Observed chance that a draft prefix is accepted, per bin of estimate.

    Each bin starts at its estimate with ``prior`` pseudo-observations, so an
    unseen bin trusts the drafter; counts decay so the map follows the
    workload. The result is made non-increasing along each draft.
    """

    def __init__(self, bins: int = 20, prior: float = 20.0, decay: float = 0.995):
        kernel.compile()
        self.bins = bins
        self.prior = prior
        self.decay = decay
        centers = (np.arange(bins) + 0.5) / bins
        self._hits = centers * prior
        self._trials = np.full(bins, prior)

    def rate(self) -> np.ndarray:
        """Observed acceptance rate per bin of estimate."""
        return self._hits / self._trials

    def lowest_estimate_above(self, rate: float) -> float:
        """An estimate below which every bin's observed rate is at most ``rate``."""
        return lowest_estimate_above(self._hits, self._trials, rate)

    def counts(self) -> tuple[np.ndarray, np.ndarray]:
        """Accepted and judged draft tokens per bin (decayed, prior included):
        ``rate()`` is their ratio. The arrays themselves, for kernels."""
        return self._hits, self._trials

    def __call__(self, probs: np.ndarray) -> np.ndarray:
        """Calibrated (R, k) chances for estimated ones (last axis along the draft)."""
        probs = np.asarray(probs, dtype=np.float64)
        if probs.size == 0:
            return probs
        flat = probs.reshape(-1, probs.shape[-1])
        out = np.empty_like(flat)
        _calibrated(flat, self.rate(), out)
        return out.reshape(probs.shape)

    def observe(self, probs: np.ndarray, sent: np.ndarray, accepted: np.ndarray) -> None:
        """``probs``: (R, k) estimates of the drafts sent, ``sent[i]`` tokens
        long; ``accepted[i]``: how many of them the verifier kept."""
        if not (type(probs) is _ndarray and probs.ndim == 2 and probs.dtype is _F64
                and type(sent) is _ndarray and sent.dtype is _I64
                and type(accepted) is _ndarray and accepted.dtype is _I64
                and len(probs) == len(sent)):  # else as given: converted
            probs = np.asarray(probs, dtype=np.float64)
            if probs.size == 0:
                return
            probs = probs.reshape(len(sent), -1)
            sent, accepted = np.asarray(sent, np.int64), np.asarray(accepted, np.int64)
        elif probs.size == 0:
            return
        _observe(probs, sent, accepted, self._hits, self._trials, self.decay)
