"""Trace confidence from token logprobs, DeepConf-style (pure logic).

DeepConf (Fu et al. 2025, "Deep Think with Confidence") scores a reasoning
path by its *lowest group confidence*: the least mean, over sliding windows
of ``window`` tokens, of a token's confidence.  A token's confidence there
is minus the mean of its top-k logprobs (a peaked distribution scores high).
vLLM returns the top-k only when asked (``logprobs=k``, extra work per draft
token); with the sampled token's logprob alone (``logprobs=0``, what the
library asks for) the token's confidence here is that logprob itself (a
sure token scores near 0, an unsure one far below).  Either way a higher
score is a surer path, and scores of the two kinds are not comparable.

:func:`trace_confidence` scores one path; :func:`confident_paths` keeps the
surest share of a problem's paths (DeepConf's filtering; its paper keeps
the top 10% or 90%) and :func:`confidence_weights` weighs them for the vote
(``Voting(weighted=True, weight_method="confidence")``);
:class:`RunningConfidence` follows a running path's window, to end it once
it falls below a threshold (DeepConf-online's early stop of a path).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["DEFAULT_WINDOW", "RunningConfidence", "confidence_weights", "confident_paths",
           "token_confidence", "trace_confidence"]

DEFAULT_WINDOW = 16  # tokens; DeepConf uses 2048 on long reasoning, the paths here are ~100 tokens


def token_confidence(entry: Any) -> float:
    """One token's confidence: a float, or a dict/sequence of one logprob
    (vLLM's ``{token id: Logprob}`` with ``logprobs=0``), is the sampled
    token's logprob (used as is); two or more are its top-k, scored minus
    their mean (DeepConf)."""
    if isinstance(entry, (int, float)) and not isinstance(entry, bool):
        return float(entry)
    values = entry.values() if isinstance(entry, dict) else entry
    lps = [float(getattr(v, "logprob", v)) for v in values]
    if not lps:
        raise ValueError("a token's logprobs are empty")
    return lps[0] if len(lps) == 1 else -sum(lps) / len(lps)


def is_top_k(entry: Any) -> bool:
    """Whether a token's entry holds its top-k (DeepConf's score) rather
    than the sampled token's logprob alone."""
    return not isinstance(entry, (int, float)) and len(entry) > 1


def trace_confidence(logprobs: Sequence[Any], window: int = DEFAULT_WINDOW) -> float | None:
    """The lowest mean token confidence over sliding windows of ``window``
    tokens (the whole path if shorter); None without tokens.  Non-finite
    logprobs (-inf for a token the sampler forced) count as very unsure."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    if not logprobs:
        return None
    scores = np.array([token_confidence(x) for x in logprobs], dtype=float)
    scores = np.nan_to_num(scores, nan=-1e3, neginf=-1e3, posinf=1e3)
    if len(scores) <= window:
        return float(scores.mean())
    sums = np.convolve(scores, np.ones(window), mode="valid")
    return float(sums.min() / window)


def confidence_weights(paths: Sequence[Sequence[Any] | None], keep: float = 0.9,
                       window: int = DEFAULT_WINDOW) -> list[float]:
    """Vote weights, DeepConf-style: 0 outside the ``keep`` share of paths
    with the highest :func:`trace_confidence`; inside it exp(score) for
    sampled-token scores (the worst window's geometric-mean probability) or
    the score for top-k ones (DeepConf's).  ``paths``: each path's per-token
    logprob entries (None or empty: no score, weight 0 unless no path has one)."""
    conf = [trace_confidence(list(lps), window) if lps else None for lps in paths]
    kept = set(confident_paths(conf, keep))
    weights = []
    for k, (lps, c) in enumerate(zip(paths, conf)):
        if k not in kept or c is None:
            weights.append(1.0 if k in kept else 0.0)  # no path scored: a plain vote
        else:
            weights.append(max(c, 0.0) if is_top_k(lps[0]) else math.exp(c))
    return weights


def confident_paths(confidences: Sequence[float | None], keep: float) -> list[int]:
    """The indices of the ``keep`` share (0 < keep <= 1) of paths with the
    highest confidence, at least one, ties kept together; paths without a
    score (None) are dropped unless none has one."""
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be a share in (0, 1], got {keep!r}")
    scored = [(c, i) for i, c in enumerate(confidences) if c is not None]
    if not scored:
        return list(range(len(confidences)))
    count = max(1, math.ceil(keep * len(scored) - 1e-9))
    cut = sorted((c for c, _ in scored), reverse=True)[count - 1]
    return sorted(i for c, i in scored if c >= cut)


@dataclass
class RunningConfidence:
    """A running path's current group confidence: the mean token confidence
    of its last ``window`` tokens (:meth:`add` each token's entry).
    ``low()`` says whether a full window has fallen below ``threshold``."""

    window: int = DEFAULT_WINDOW
    threshold: float = -math.inf

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")
        self._last: deque = deque(maxlen=self.window)
        self._sum = 0.0

    def add(self, entry: Any) -> None:
        score = token_confidence(entry)
        score = -1e3 if not math.isfinite(score) else score
        if len(self._last) == self.window:
            self._sum -= self._last[0]
        self._last.append(score)
        self._sum += score

    @property
    def current(self) -> float | None:
        return self._sum / len(self._last) if self._last else None

    def low(self) -> bool:
        return len(self._last) == self.window and self._sum / self.window < self.threshold
