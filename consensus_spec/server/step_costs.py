"""What a batch row costs the engine, measured in the API server.

vLLM hands every engine step's scheduler stats to the API server's stat
loggers (``vllm.stat_logger_plugins``).  This package registers one,
:class:`StepCostLogger`, under the endpoint's own plugin name, so the
``VLLM_PLUGINS`` entry that serves the routes also turns it on.  While the
engine keeps running, the time from one step's stats to the next is that
step's time; with the rows it ran (the running count after the step
before) and the draft tokens it verified, it trains
:class:`~consensus_spec.budget.row_costs.RowStepCosts` (a local linear fit
of step time in rows and draft tokens, a step-cost model as its prior),
as the draft budget learns from the engine's timed steps.  Steps that
admitted a request (a prefill) or followed an idle engine are left out.
:class:`EngineStepCosts` then answers the run-ahead's question
(:class:`~consensus_spec.sampling.run_ahead.RowCosts`): how much slower
the step gets with more rows.

Without stats (``--disable-log-stats``) the prior alone answers, and the
server's start-up line says so.  It also keeps the engine's running and
waiting counts after each step: the load a request's schedule is chosen by
(:mod:`~consensus_spec.sampling.load_policy`).  The logger never raises into vLLM: a
failing record is counted and, after a few, recording stops.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from ..budget import cost_model
from ..budget.row_costs import RowStepCosts
from . import PLUGIN_NAME

logger = logging.getLogger(f"vllm.{__name__}")

MAX_STEP_MS = 10_000.0  # a longer gap is the engine waiting, not a step
MAX_FAILURES = 8

_COSTS: "EngineStepCosts | None" = None  # one per API server process


def ensure_costs(vllm_config) -> "EngineStepCosts":
    """The process's step costs, made on first use with the prior that
    suits the engine's device (the stat logger, if vLLM loaded it, trains it)."""
    global _COSTS
    if _COSTS is None:
        _COSTS = EngineStepCosts(_prior_for(vllm_config))
    return _COSTS


class EngineStepCosts:
    """T(B) as the engine's own steps show it; implements ``RowCosts``."""

    def __init__(self, prior_name: str):
        self.prior_name = prior_name
        self.fit = RowStepCosts(cost_model(prior_name))
        self._last: dict[int, tuple[float, int]] = {}  # engine -> (time, running after it)
        self._running: dict[int, int] = {}
        self._waiting: dict[int, int] = {}  # engine -> requests queued after its last step
        # the caller's own requests in flight (a callable), read at each step: the engine's
        # counts are as of its last step, so other requests are what they held beyond ours then
        self.own_rows: Callable[[], int] | None = None
        self._own_at_step = 0
        self.steps_seen = 0
        self.steps_used = 0
        self.measured = False  # a stat logger feeds it (else the prior alone answers)

    def record(self, engine: int, running: int, drafted: int, prefill: bool,
               now: float | None = None, waiting: int = 0) -> None:
        now = time.monotonic() if now is None else now
        last = self._last.get(engine)
        self._last[engine] = (now, running)
        self._running[engine] = running
        self._waiting[engine] = waiting
        if self.own_rows is not None:
            self._own_at_step = self.own_rows()
        self.steps_seen += 1
        if last is None or last[1] <= 0 or prefill:
            return
        step_ms = (now - last[0]) * 1000.0
        batch = last[1]
        if not 0.0 < step_ms < MAX_STEP_MS:
            return
        if self.fit.observe(batch, drafted, step_ms):
            self.steps_used += 1

    # -- RowCosts ------------------------------------------------------------

    def rows(self) -> int:
        return max(self._running.values(), default=0)

    def waiting(self) -> int:
        """Requests queued in the engine after its last step (the most of any engine)."""
        return max(self._waiting.values(), default=0)

    def other_rows(self) -> int:
        """Rows and queue places of requests not the caller's (``own_rows``) at the last
        step: paths aborted since then are not counted as someone else's."""
        return max(0, sum(self._running.values()) + sum(self._waiting.values()) - self._own_at_step)

    def elasticity(self, rows: int, extra: int) -> float:
        return self.fit.kappa(rows, extra)

    def summary(self) -> dict:
        """For ``GET /v1/self_consistency/state``: what was measured."""
        return {"prior": self.prior_name, "measured": self.measured, "steps_seen": self.steps_seen,
                "steps_used": self.steps_used, "steps_clipped": self.fit.steps_clipped,
                "rows_now": self.rows(), "waiting_now": self.waiting(),
                "by_rows": self.fit.summary()}


def _prior_for(vllm_config) -> str:
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cuda")
    return "cpu_embedded" if device == "cpu" else "h200_7b"


def _endpoint_named() -> bool:
    allowed = os.environ.get("VLLM_PLUGINS")
    return allowed is not None and PLUGIN_NAME in [p.strip() for p in allowed.split(",")]


def _make_logger_class():
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepCostLogger(StatLoggerBase):
        """Feeds each engine step's rows, drafts and time to :class:`EngineStepCosts`."""

        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index
            self.failures = 0
            # vLLM loads every stat logger when VLLM_PLUGINS is unset; without
            # the endpoint nothing reads the fit, so it records nothing
            self.costs = ensure_costs(vllm_config) if _endpoint_named() else None
            if self.costs is not None:
                self.costs.measured = True

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if self.costs is None or scheduler_stats is None or self.failures >= MAX_FAILURES:
                return
            try:
                spec = getattr(scheduler_stats, "spec_decoding_stats", None)
                drafted = int(getattr(spec, "num_draft_tokens", 0) or 0) if spec else 0
                prefill = bool(getattr(iteration_stats, "num_prompt_tokens", 0))
                self.costs.record(engine_idx, int(scheduler_stats.num_running_reqs), drafted,
                                  prefill, waiting=int(scheduler_stats.num_waiting_reqs))
            except Exception:  # noqa: BLE001 - never into vLLM's output handler
                self.failures += 1
                if self.failures >= MAX_FAILURES:
                    logger.warning("consensus_spec: step-cost recording failed %d times; stopped "
                                   "(run-ahead keeps the last fit)", self.failures, exc_info=True)

        def log_engine_initialized(self):
            pass

    return StepCostLogger


def __getattr__(name: str):
    # the entry point names StepCostLogger; vLLM is imported only when it is asked for
    if name == "StepCostLogger":
        cls = _make_logger_class()
        globals()["StepCostLogger"] = cls
        return cls
    raise AttributeError(name)
