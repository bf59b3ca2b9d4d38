"""Replay from a measured prior: the start-up profile emulated, and a run
starting from what an earlier one remembered.

``--startup-profile NOISE``: each consensus run starts from the table a
start-up profile would time: the truth (``--costs``, as the replay's clock
reads it) at every bucket's batch size from 1 to the run's rows and at
q = 1, 2, 3, 5, 9, each point times (1 + NOISE * a standard normal draw,
seeded per run): measurement noise of relative sd NOISE. Its prior model is
the roofline fitted to those points.

``--save-costs DIR``: after each consensus run, what its proposer remembers
(its own save, through ``remember_costs``) is kept as DIR/SET_B<rows>.json.
``--costs-from DIR``: each consensus run starts from DIR/SET_B<rows>.json
(an earlier run's ``--save-costs``), as an engine restarted on the same
machine would.

The proposer loads and saves through its real path (``CostMemory``): the
replay only names a machine (``name_machine``) and a temporary folder per run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from types import SimpleNamespace

import numpy as np

MACHINE = "replay"


def name_machine(cfg, model: str) -> None:
    """Give a stand-in config what the proposer's step-cost memory keys on."""
    cfg.model_config.model = model
    cfg.model_config.dtype = MACHINE
    cfg.parallel_config.data_parallel_size = 1
    cfg.device_config = SimpleNamespace(device_type="cuda", device_name=MACHINE)


def profile_rows(truth, max_rows: int, noise: float, rng) -> list[dict]:
    from consensus_spec.budget.measured import Q_POINTS
    from consensus_spec.budget.online import BUCKETS_PER_OCTAVE, bucket_of

    sizes = truth.batch_sizes
    # one batch size per bucket the run can reach (some buckets hold no integer size)
    batches = [b for i, b in ((i, int(round(2 ** (i / BUCKETS_PER_OCTAVE)))) for i in range(64))
               if b <= max_rows and bucket_of(b) == i]
    rows = []
    for b in batches:
        for q in Q_POINTS:
            ms = truth.step_ms_between(min(max(b, sizes[0]), sizes[-1]), float(q))
            rows.append({"B": b, "q": q, "ms": ms * max(1.0 + noise * rng.standard_normal(), 0.5),
                         "noise": noise})
    return rows


class StartupCosts:
    """One consensus run's step-cost memory: where it starts from, and what it keeps."""

    def __init__(self, args, truth, name: str, batch: int, tag: str = ""):
        from consensus_spec.budget import StepCostModel, remember
        from consensus_spec.vllm.memory import machine_key

        from .drafters import stand_in_config

        self.args, self.cell = args, f"{name}_B{batch}"
        self.model = f"{MACHINE}:{os.path.basename(args.costs)}"
        self.dir = tempfile.mkdtemp(prefix="replay_step_costs_")
        self.options = {"step_costs_dir": self.dir, "remember_costs": True}
        cfg = stand_in_config(args.k, 1, batch)
        name_machine(cfg, self.model)
        key = machine_key(cfg)
        path = remember.path_for(key, self.dir)
        self.info: dict = {}
        if args.costs_from:
            src = os.path.join(args.costs_from, self.cell + ".json")
            if not os.path.exists(src):
                raise FileNotFoundError(f"--costs-from: no saved table {src}")
            shutil.copy(src, path)
            self.info["start"] = f"saved {src}"
        elif args.startup_profile is not None:
            rng = np.random.default_rng(zlib.crc32(f"{args.profile_seed} {self.cell}{tag}".encode()))
            rows = profile_rows(truth, batch, args.startup_profile, rng)
            remember.save(path, key, StepCostModel.fit(rows), rows)
            # a profile times each point 3 times after one warm-up step: its device time
            self.info.update(start=f"profile, noise {args.startup_profile:g}", profile_points=len(rows),
                             profile_device_s=round(4 * sum(r["ms"] for r in rows) / 1000.0, 2))

    def finish(self, proposer) -> dict:
        saved = proposer.save_step_costs()
        if saved and self.args.save_costs:
            os.makedirs(self.args.save_costs, exist_ok=True)
            dest = os.path.join(self.args.save_costs, self.cell + ".json")
            shutil.copy(saved, dest)
            self.info["saved"] = dest
        shutil.rmtree(self.dir, ignore_errors=True)
        return self.info


def for_run(args, truth, method: str, clock, name: str, batch: int, tag: str = ""):
    """The run's StartupCosts, or None where nothing is remembered."""
    wanted = (getattr(args, "startup_profile", None) is not None or getattr(args, "costs_from", None)
              or getattr(args, "save_costs", None))
    if not wanted or method != "consensus" or clock is None:
        return None
    return StartupCosts(args, truth, name, batch, tag)
