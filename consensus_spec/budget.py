"""Batch-aware draft budget: how many draft tokens each row gets this step.

Verifying drafts is nearly free at small batch and expensive at large batch.
Given each row's draft with the estimated chance that every prefix is
accepted, the budget keeps the prefixes that maximise expected tokens per
unit of step time, ``(B + sum of kept probabilities) / T(B, 1 + kept / B)``,
under a step-cost model ``T(B, q)``: the time of one forward step over B rows
with q query tokens each.

The default model is a roofline fitted to step times measured on an H200 for
a Qwen2.5-7B-shaped decoder (bf16, CUDA graphs, 1,024-token context; mean
error 3%, worst 24% where GEMM tiling jumps):

    T(B, q) = (w^s + (c * B * q)^s)^(1/s) + a * B    [ms]

w is the weight-read floor, c the compute time per query token, a the
attention (KV read) time per row, s the sharpness of the bend. Register
other models in ``COST_MODELS`` (in the engine process) or pass
``cost_model="off"`` to draft as long as the drafter is confident.

The drafter's own estimates come from few sightings and run high, so an
``AcceptanceCalibrator`` maps them to the acceptance rate observed so far in
this engine, per bin of estimate, before the budget uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepCostModel:
    weights_ms: float
    ms_per_token: float
    attention_ms_per_row: float
    sharpness: float

    def step_ms(self, batch: int, q):
        n = self.ms_per_token * batch * np.asarray(q, dtype=np.float64)
        s = self.sharpness
        return (self.weights_ms ** s + n ** s) ** (1.0 / s) + self.attention_ms_per_row * batch


COST_MODELS: dict[str, StepCostModel] = {
    # fitted to ../shared/data/costs/h200_qwen2.5-7b_step_ms.jsonl
    "h200_7b": StepCostModel(4.2033, 0.022518, 0.012737, 2.1495),
}


def cost_model(name: str) -> StepCostModel | None:
    if name == "off":
        return None
    if name not in COST_MODELS:
        raise ValueError(f"unknown cost model {name!r}; known: {sorted(COST_MODELS)} or 'off'")
    return COST_MODELS[name]


def _valid(lengths: np.ndarray, k: int) -> np.ndarray:
    """(R, k) mask of the entries inside each row's draft."""
    return np.arange(k)[None, :] < np.asarray(lengths)[:, None]


def choose_lengths(probs: np.ndarray, lengths: np.ndarray, batch: int,
                   model: StepCostModel) -> np.ndarray:
    """Per-row draft lengths maximising expected tokens per step time.

    ``probs[i, j]`` (an R x k array; entries ``j >= lengths[i]`` are ignored)
    is the chance that row i's first j+1 draft tokens are all accepted,
    non-increasing in j. ``batch`` counts every row in the step, drafting or
    not. Returns lengths no longer than ``lengths``.
    """
    probs = np.asarray(probs, dtype=np.float64)
    valid = _valid(lengths, probs.shape[1]) if probs.ndim == 2 else np.zeros((0, 0), bool)
    flat = probs[valid]
    if flat.size == 0 or batch <= 0:
        return np.zeros(len(lengths), np.int64)
    order = np.sort(flat)[::-1]
    kept = np.arange(order.size + 1)
    gain = batch + np.concatenate(([0.0], np.cumsum(order)))
    rate = gain / model.step_ms(batch, 1.0 + kept / batch)
    best = int(np.argmax(rate))
    if best == 0:
        return np.zeros(len(lengths), np.int64)
    return ((probs >= order[best - 1]) & valid).sum(axis=1)


class AcceptanceCalibrator:
    """Observed chance that a draft prefix is accepted, per bin of estimate.

    Each bin starts at its estimate with ``prior`` pseudo-observations, so an
    unseen bin trusts the drafter; counts decay so the map follows the
    workload. The result is made non-increasing along each draft.
    """

    def __init__(self, bins: int = 20, prior: float = 20.0, decay: float = 0.995):
        self.bins = bins
        self.prior = prior
        self.decay = decay
        centers = (np.arange(bins) + 0.5) / bins
        self._hits = centers * prior
        self._trials = np.full(bins, prior)

    def _bin(self, probs: np.ndarray) -> np.ndarray:
        return np.minimum((probs * self.bins).astype(np.int64), self.bins - 1)

    def __call__(self, probs: np.ndarray) -> np.ndarray:
        """Calibrated (R, k) chances for estimated ones (any shape, last axis
        along the draft)."""
        probs = np.asarray(probs, dtype=np.float64)
        if probs.size == 0:
            return probs
        rate = self._hits / self._trials
        return np.minimum.accumulate(rate[self._bin(probs)], axis=-1)

    def observe(self, probs: np.ndarray, sent: np.ndarray, accepted: np.ndarray) -> None:
        """``probs``: (R, k) estimates of the drafts sent, ``sent[i]`` tokens
        long; ``accepted[i]``: how many of them the verifier kept."""
        probs = np.asarray(probs, dtype=np.float64)
        if probs.size == 0:
            return
        valid = _valid(sent, probs.shape[1])
        if not valid.any():
            return
        hit = np.arange(probs.shape[1])[None, :] < np.asarray(accepted)[:, None]
        self._hits *= self.decay
        self._trials *= self.decay
        idx = self._bin(probs[valid])
        np.add.at(self._trials, idx, 1.0)
        np.add.at(self._hits, idx, hit[valid].astype(np.float64))
