"""Projected decode speedup on a measured GPU step-cost table.

speedup(B) = tau * T(B, 1) / (T(B, 1 + d) + c), with T interpolated linearly
in the query length q, d the draft tokens per row-step and c the drafter's
time per step (it runs serially between model steps in vLLM). A projection,
not a measurement: it ignores sampler and scheduler time.
"""

from __future__ import annotations

import json
import os

import numpy as np


class StepCosts:
    def __init__(self, rows: list[dict]):
        self._table: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        by_b: dict[int, list[tuple[float, float]]] = {}
        for r in rows:
            by_b.setdefault(int(r["B"]), []).append((float(r["q"]), float(r["ms"])))
        for b, pts in by_b.items():
            pts.sort()
            self._table[b] = (np.array([q for q, _ in pts]), np.array([ms for _, ms in pts]))

    @classmethod
    def load(cls, path: str) -> "StepCosts":
        if not os.path.exists(path):
            raise FileNotFoundError(f"step-cost table not found: {path}")
        with open(path, encoding="utf-8") as f:
            return cls([json.loads(line) for line in f if line.strip()])

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(self._table)

    def step_ms(self, batch: int, q: float) -> float:
        if batch not in self._table:
            raise ValueError(f"batch size {batch} not in cost table {self.batch_sizes}")
        qs, ms = self._table[batch]
        if q > qs[-1]:  # extrapolate along the last segment
            slope = (ms[-1] - ms[-2]) / (qs[-1] - qs[-2])
            return float(ms[-1] + slope * (q - qs[-1]))
        return float(np.interp(q, qs, ms))

    def speedup(self, batch: int, tau: float, drafts_per_step: float, drafter_us_per_row: float) -> float:
        c_ms = drafter_us_per_row * batch / 1000.0
        return tau * self.step_ms(batch, 1.0) / (self.step_ms(batch, 1.0 + drafts_per_step) + c_ms)
