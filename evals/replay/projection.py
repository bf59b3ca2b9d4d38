"""Projected decode speedup on a measured GPU step-cost table.

Async-unaware (the project's original view; host time left out of both):

    speedup(B) = tau * T(B, 1) / (T(B, 1 + d) + c)

with T interpolated linearly in the query length q, d the draft tokens per
row-step and c the drafter's time per step (it runs serially between model
steps in vLLM).

Async-aware: vLLM runs no drafting with async scheduling, which hides the
host's per-step work h(B) behind the GPU step (the step takes the longer of
the two), and switches async scheduling off for custom_class, suffix and CPU
ngram drafters, whose steps then pay it:

    speedup(B) = tau * max(T(B, 1), h(B)) / (T(B, 1 + d) + c + h(B))

h(B) comes from a host-time table (``python -m evals host-time``). A
projection, not a measurement: it ignores the sampler, and h is measured on
another CPU than a GPU server's.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
import zlib

import numpy as np

from ..traces import shared_path
from .drafters import MACHINE, name_machine, stand_in_config

# the measured H200 table (../shared); a clone without it projects on the budget's model of it
DEFAULT_COSTS = shared_path("costs", "h200_qwen2.5-7b_step_ms.jsonl")
DEFAULT_HOST_TIME = "results/host_time.jsonl"
# The same measurement at 256 and 512 rows, beyond the shared table's 128, made by this
# project (python -m evals gpu-step-costs, issue 50; at 64 and 128 rows it read 0.87-1.08
# of the shared table's GEMM time for the 7B shape, 0.75-0.88 for the 1.5B): a table of
# a model it covers takes these rows at batch sizes beyond its own.
LARGE_BATCHES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "h200_large_batches.jsonl")


def _along(x: float, xs, ys) -> float:
    """``ys`` at ``x``: linear between points, the first value below them,
    extrapolated along the last segment above them."""
    if len(xs) > 1 and x > xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return float(ys[-1] + slope * (x - xs[-1]))
    return float(np.interp(x, xs, ys))


def _read_jsonl(path: str, what: str) -> list[dict]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} not found: {path}")
    with open(path, encoding="utf-8") as f:
        try:
            return [json.loads(line) for line in f if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSONL {what}: {e}") from None


class StepCosts:
    def __init__(self, rows: list[dict]):
        self.extended: list[int] = []  # batch sizes taken from LARGE_BATCHES
        by_b: dict[int, list[tuple[float, float]]] = {}
        for r in rows:
            by_b.setdefault(int(r["B"]), []).append((float(r["q"]), float(r["ms"])))
        # per batch size, its (q, ms) points sorted by q as two arrays
        self._table = {b: tuple(np.array(x) for x in zip(*sorted(pts))) for b, pts in by_b.items()}

    @classmethod
    def load(cls, path: str) -> "StepCosts":
        """The table at ``path``, with :data:`LARGE_BATCHES`' rows of its
        model at batch sizes beyond its largest."""
        rows = _read_jsonl(path, "step-cost table")
        top = max((int(r["B"]) for r in rows), default=0)
        models = {r.get("model") for r in rows} - {None}
        more = [r for r in _read_jsonl(LARGE_BATCHES, "step-cost table")
                if len(models) == 1 and r["model"] in models and int(r["B"]) > top]
        table = cls(rows + more)
        table.extended = sorted({int(r["B"]) for r in more})
        return table

    @classmethod
    def from_model(cls, name) -> "StepCosts":
        """A table of one of the budget's cost models (a name, or the model
        itself), on the measured H200 table's grid (B 1..256, 1..17 tokens per row)."""
        from consensus_spec.budget import cost_model
        model = cost_model(name) if isinstance(name, str) else name
        return cls([{"B": b, "q": q, "ms": float(model.step_ms(b, q))}
                    for b in (1, 8, 16, 32, 64, 128, 256) for q in (1, 2, 3, 5, 9, 17)])

    def with_slope_scale(self, scale: float) -> "StepCosts":
        """The same table with every step's cost above one token per row
        times ``scale``: T'(B, q) = T(B, 1) + scale (T(B, q) - T(B, 1))."""
        one = {b: float(np.interp(1.0, qs, ms)) for b, (qs, ms) in self._table.items()}
        return StepCosts([{**r, "ms": one[r["B"]] + scale * (r["ms"] - one[r["B"]])} for r in self.rows()])

    def rows(self) -> list[dict]:
        """The table as {"B", "q", "ms"} rows (what it was read from, scaled)."""
        return [{"B": b, "q": float(q), "ms": float(m)}
                for b, (qs, ms) in sorted(self._table.items()) for q, m in zip(qs, ms)]

    def to_file(self, prefix: str) -> str:
        """:meth:`rows` as a JSONL file (removed at exit): a cost model a budget takes."""
        fd, path = tempfile.mkstemp(prefix=prefix, suffix=".jsonl")
        with os.fdopen(fd, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in self.rows())
        atexit.register(os.unlink, path)
        return path

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(self._table)

    def step_ms(self, batch: int, q: float) -> float:
        if batch not in self._table:
            raise ValueError(f"batch size {batch} not in cost table {self.batch_sizes}")
        return _along(q, *self._table[batch])

    def step_ms_between(self, batch: int, q: float) -> float:
        """:meth:`step_ms` at any batch size from the smallest measured to the
        largest, linear in B between measured sizes (a wave run's batch
        varies step by step)."""
        sizes = self.batch_sizes
        if not sizes[0] <= batch <= sizes[-1]:
            raise ValueError(f"batch size {batch} outside the cost table's {sizes[0]}..{sizes[-1]}")
        if batch in self._table:
            return self.step_ms(batch, q)
        hi = next(b for b in sizes if b > batch)
        lo = max(b for b in sizes if b < batch)
        w = (batch - lo) / (hi - lo)
        return (1 - w) * self.step_ms(lo, q) + w * self.step_ms(hi, q)

    def step_ms_clamped(self, batch: int, q: float) -> float:
        """:meth:`step_ms_between` with ``batch`` held to the measured range."""
        sizes = self.batch_sizes
        return self.step_ms_between(min(max(batch, sizes[0]), sizes[-1]), q)

    def speedup(self, batch: int, tau: float, drafts_per_step: float, drafter_us_per_row: float,
                host_ms: float = 0.0, async_base: bool = False) -> float:
        """Drafting over no drafting, both without async scheduling and paying
        ``host_ms`` per step (0: async-unaware, host time left out of both);
        ``async_base``: no drafting keeps async scheduling, its host time
        hidden behind the step (the async-aware view)."""
        c_ms = drafter_us_per_row * batch / 1000.0
        t1 = self.step_ms(batch, 1.0)
        base = max(t1, host_ms) if async_base else t1 + host_ms
        return tau * base / (self.step_ms(batch, 1.0 + drafts_per_step) + c_ms + host_ms)


class HostTime:
    """Host-side ms per engine step by batch size, from ``{"B", "host_ms"}``
    rows: linear in B between measured sizes, the nearest measured value
    below the smallest, extrapolated along the last segment above the largest."""

    def __init__(self, rows: list[dict]):
        pts = sorted((int(r["B"]), float(r["host_ms"])) for r in rows)
        if not pts:
            raise ValueError("a host-time table needs at least one {\"B\", \"host_ms\"} row")
        if len({b for b, _ in pts}) != len(pts):
            raise ValueError("host-time table has repeated batch sizes")
        if any(ms < 0 for _, ms in pts):
            raise ValueError("host-time table has negative host_ms")
        self.b = np.array([b for b, _ in pts], dtype=np.float64)
        self.ms = np.array([ms for _, ms in pts], dtype=np.float64)
        self.source = None

    @classmethod
    def load(cls, path: str) -> "HostTime":
        rows = _read_jsonl(path, "host-time table")
        try:
            table = cls(rows)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: rows need B and host_ms ({e})") from None
        table.source = path
        return table

    def host_ms(self, batch: int) -> float:
        return max(_along(batch, self.b, self.ms), 0.0)


def break_even_host_ms(costs: StepCosts, batch: int, tau: float, drafts_per_step: float,
                       drafter_us_per_row: float) -> float:
    """The host time per step up to which a drafting engine without async
    scheduling still matches no drafting with it (async-aware speedup 1.0).

    Below T(B, 1) the async-aware speedup falls as host time grows, to its
    lowest at h = T(B, 1) (beyond, no drafting is host-bound too); so this is
    ``tau T(B,1) - T(B,1+d) - c`` (negative: never), or infinity when even
    h = T(B, 1) leaves drafting ahead."""
    c_ms = drafter_us_per_row * batch / 1000.0
    t1, td = costs.step_ms(batch, 1.0), costs.step_ms(batch, 1.0 + drafts_per_step)
    h = tau * t1 - td - c_ms
    return float("inf") if h >= t1 else h


def run_ms(costs: StepCosts, step_rows, step_drafted, drafter_ms=None,
           host: HostTime | None = None, hide_host: bool = False) -> float:
    """Projected time of a whole run, step by step: ``T(B, 1 + d/B)`` for each
    step's B rows and d draft tokens, plus the drafter's time that step
    (``drafter_ms``, serial in vLLM).  With ``host``: each step pays h(B)
    serially, or only beyond T with ``hide_host`` (async scheduling, which
    vLLM keeps only without drafting).  A step of 0 rows (the drafter's
    call after the last rows finished) costs only the drafter's time."""
    total = 0.0
    for s, (b, d) in enumerate(zip(step_rows, step_drafted)):
        t = drafter_ms[s] if drafter_ms is not None else 0.0
        if b == 0:  # the drafter's last call after the last rows finished
            total += t
            continue
        t += costs.step_ms_between(int(b), 1.0 + d / b)
        if host is not None:
            h = host.host_ms(int(b))
            t = max(t, h) if hide_host else t + h
        total += t
    return total


def add_table_args(ap) -> None:
    """``--costs`` and ``--host-time``: the tables :func:`load_tables` reads."""
    ap.add_argument("--costs", default=DEFAULT_COSTS, help="step-cost table ({\"B\", \"q\", \"ms\"} JSONL)")
    ap.add_argument("--host-time", default=DEFAULT_HOST_TIME,
                    help="host ms per step by batch size ({\"B\", \"host_ms\"} JSONL from "
                         "`python -m evals host-time`) for the async-aware projection; "
                         "'none' to leave that view out")


def load_tables(args, quiet: bool = False) -> tuple[StepCosts | None, HostTime | None]:
    """The step-cost table and the host-time table (None where not given).
    Without ../shared, the default table falls back to the budget's own H200
    model on that table's grid (a fit to it: mean error 3%), so a clone
    still projects."""
    costs = StepCosts.load(args.costs) if args.costs and os.path.exists(args.costs) else None
    if costs is None and args.costs == DEFAULT_COSTS:
        costs = StepCosts.from_model("h200_7b")
        if not quiet:
            print(f"note: no measured table at {args.costs}; projecting on the budget's H200 "
                  "model (consensus_spec.budget.COST_MODELS['h200_7b'], fitted to it)",
                  file=sys.stderr)
    scale = getattr(args, "costs_slope_scale", 1.0)  # waves and dp-replay share this
    if costs is not None and scale != 1.0:
        costs = costs.with_slope_scale(scale)
    host = None
    if args.host_time and args.host_time != "none":
        if os.path.exists(args.host_time):
            host = HostTime.load(args.host_time)
        elif args.host_time != DEFAULT_HOST_TIME:
            raise FileNotFoundError(f"host-time table not found: {args.host_time}")
        elif not quiet:
            print(f"note: no host-time table at {args.host_time} (python -m evals host-time); "
                  "the async-aware view is left out", file=sys.stderr)
    return costs, host


def pair_runs(results: list[dict]) -> list[dict]:
    """Each row's ``run_speedup``: no drafting's whole projected run over its
    own, the same trace set and batch size (every step, the drain included)."""
    none = {(r["traces"], r["batch"]): r["run_ms"] for r in results
            if r["method"] == "none" and r.get("run_ms")}
    for r in results:
        base = none.get((r["traces"], r["batch"]))
        if base and r.get("run_ms"):
            r["run_speedup"] = base / r["run_ms"]
    return results


# -- the start-up profile emulated (replay --startup-profile, --save-costs, --costs-from), as
# docs/step_costs_prior.md ("Replay") describes it.  The proposer loads and saves through its real
# path (``CostMemory``): the replay only names a machine (``name_machine``) and a temporary folder per run.


def profile_rows(truth, max_rows: int, noise: float, rng) -> list[dict]:
    from consensus_spec.budget.measured import Q_POINTS
    from consensus_spec.budget.online import BUCKETS_PER_OCTAVE, bucket_of

    # one batch size per bucket the run can reach (some buckets hold no integer size)
    batches = [b for i, b in ((i, int(round(2 ** (i / BUCKETS_PER_OCTAVE)))) for i in range(64))
               if b <= max_rows and bucket_of(b) == i]
    rows = []
    for b in batches:
        for q in Q_POINTS:
            ms = truth.step_ms_clamped(b, float(q))
            rows.append({"B": b, "q": q, "ms": ms * max(1.0 + noise * rng.standard_normal(), 0.5),
                         "noise": noise})
    return rows


class StartupCosts:
    """One consensus run's step-cost memory: where it starts from, and what it keeps."""

    def __init__(self, args, truth, name: str, batch: int, tag: str = ""):
        from consensus_spec.budget import StepCostModel, remember
        from consensus_spec.vllm.memory import machine_key

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
    wanted = args.startup_profile is not None or args.costs_from or args.save_costs
    if not wanted or method != "consensus" or clock is None:
        return None
    return StartupCosts(args, truth, name, batch, tag)
