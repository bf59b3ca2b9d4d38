"""The proposer's remembered step costs (``remember_costs``, with
``cost_model=auto``): the key vLLM's config gives this engine, the file
read once at start, and saves now and then as steps are timed, and once
more when the proposer goes (collected, or at exit). The file format and
its checks are :mod:`consensus_spec.budget.remember`.

Never fatal: a file that cannot be used is one WARNING and a start from
the default prior; a save that fails is one WARNING and no more tries.
"""

from __future__ import annotations

import logging
import os
import time
import weakref

from ..budget import remember

logger = logging.getLogger(f"vllm.{__name__}")

SAVE_EVERY_STEPS = 256  # timed steps between save attempts...
SAVE_EVERY_S = 60.0     # ...at most this often (wall time, not the replaceable clock)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), "cpu")
    except OSError:
        name = "cpu"
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 0
    return f"{name} x{cores}"


def device_name(vllm_config) -> str:
    device = getattr(vllm_config, "device_config", None)
    named = getattr(device, "device_name", None)  # a stand-in (replay) names its own
    if named:
        return str(named)
    if getattr(device, "device_type", "cuda") == "cpu":
        # the same CPU runs other kernels under another ISA (AVX2 against AVX-512:
        # a draft token cost several times more): their step costs are not shared
        import torch
        return f"{_cpu_name()} [{torch.backends.cpu.get_cpu_capability()}]"
    from vllm.platforms import current_platform
    return str(current_platform.get_device_name())


def machine_key(vllm_config) -> dict | None:
    """What identifies this engine's step costs; None where the config does
    not name a model (a light stand-in: nothing is remembered)."""
    model_config = getattr(vllm_config, "model_config", None)
    model = getattr(model_config, "model", None)
    if not model:
        return None
    parallel = getattr(vllm_config, "parallel_config", None)
    import vllm
    return {"model": str(model), "dtype": str(getattr(model_config, "dtype", "")),
            "device": device_name(vllm_config),
            "tp": int(getattr(parallel, "tensor_parallel_size", 1) or 1),
            "dp": int(getattr(parallel, "data_parallel_size", 1) or 1),
            "vllm": str(getattr(vllm, "__version__", "?"))}


class CostMemory:
    def __init__(self, key: dict, directory: str, owner):
        self.key = key
        self.path = remember.path_for(key, directory)
        self.folder = os.path.dirname(self.path)
        self.folder_seen = os.path.isdir(self.folder)  # here at start, or made by a save
        self.budget = None  # the owner's current budget (it says): what a save writes
        self._last_save = None
        self._failed = False
        self.saves = 0
        # the last save: when the proposer is collected (an engine shut down before the
        # process ends: the evals' runs) or at exit, whichever comes first
        weakref.finalize(owner, self.save_last)

    @classmethod
    def for_engine(cls, vllm_config, directory: str, owner) -> "CostMemory | None":
        try:
            key = machine_key(vllm_config)
        except Exception:  # noqa: BLE001 - no key, no memory; drafting goes on
            logger.warning("consensus_spec: cannot tell this engine's device; step costs are not "
                           "remembered", exc_info=True)
            return None
        return cls(key, directory or remember.default_dir(), owner) if key else None

    def load(self) -> dict | None:
        table, problem = remember.load(self.path, self.key)
        if problem:
            logger.warning("consensus_spec: remembered step costs %s not used (%s); starting from "
                           "the default prior", self.path, problem)
        elif table is not None:
            by_b: dict[int, list[float]] = {}
            for r in table["rows"]:
                by_b.setdefault(r["B"], []).append(r["ms"])
            logger.info("consensus_spec: step costs remembered in %s (saved %s) are the prior; "
                        "ms per step at q=1/2/3/5/9 by rows: %s", self.path,
                        time.strftime("%Y-%m-%d %H:%M", time.localtime(table["saved_at"])),
                        "; ".join(f"{b}: {'/'.join(f'{x:.2f}' for x in ms)}"
                                  for b, ms in sorted(by_b.items())))
        return table

    def save_last(self) -> str | None:
        """:meth:`save`, unless the folder was removed while this ran (it stays
        removed). One that never was (a fresh machine's cache before any periodic
        save: a short run, or one at 256 rows that times few steps) is made, or
        nothing would ever be remembered there."""
        if os.path.isdir(self.folder) or not self.folder_seen:
            return self.save()
        return None

    def maybe_save(self) -> None:
        now = time.monotonic()
        if self._last_save is None or now - self._last_save >= SAVE_EVERY_S:
            self.save()

    def save(self) -> str | None:
        """Write what the owner's budget learned; the path, or None (nothing
        learned yet, or a failure: logged once)."""
        budget = self.budget
        costs = getattr(budget, "costs", None)
        if self._failed or costs is None or not costs.steps_observed:
            return None
        self._last_save = time.monotonic()
        try:
            rows = costs.export()
            if not rows:
                return None
            off = budget.guard.summary()["drafting_off_at_rows"]
            remember.save(self.path, self.key, costs.prior, rows, off)
        except Exception as e:  # noqa: BLE001 - remembering is a convenience, never a failure
            self._failed = True
            logger.warning("consensus_spec: cannot save step costs to %s (%s: %s); not trying again",
                           self.path, type(e).__name__, e)
            return None
        self.saves += 1
        self.folder_seen = True
        return self.path
