"""Replay benchmark: every drafter on every trace set, in one run.

    python -m evals replay [--traces FILE ...] [--batches 16 64 128] [--k 8]
                           [--schedules sweep|fixed] [--tune-limit 100]
                           [--host-time results/host_time.jsonl] [--repeats 2]
    python -m evals replay --from-json results/replay.json --host-time OTHER.jsonl

Methods (see ``evals/drafters.py``): no drafting; vLLM's ngram and suffix,
each under the best ``num_speculative_tokens_per_batch_size`` schedule a
sweep over k finds (``--schedules sweep``: per trace set, on its first
``--tune-limit`` problems, k in ``--sweep-k`` at each batch size; then every
method runs on the whole set) or at k everywhere (``fixed``); suffix with its
drafts cut by this project's batch-aware budget; consensus with the budget
off (the drafter alone); consensus.

Each figure is a projected H200 decode speedup over no drafting, from the
measured step-cost table (``--costs``), τ and drafts per row-step from the
replay, and the drafter's CPU time per step measured here: a projection, not
a GPU measurement. Two views (``evals/projection.py``): async-unaware (host
time left out) and async-aware (no drafting keeps async scheduling and hides
the host time of ``--host-time``; drafting engines pay it serially).

Prints one markdown table per trace set and writes them, the sweep and every
figure to ``--out``.md/.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from tqdm import tqdm

from .cli import parse_options
from .device_route import device_us_per_row
from .drafters import DEVICE_METHODS, METHODS, SCHEDULABLE, make_drafter
from .projection import HostTime, StepCosts, break_even_host_ms
from .replay import VirtualClock, replay
from .replay_report import markdown, sweep_markdown, targets
from .traces import TraceError, load_problems, load_tokenizer, shared_path

DEFAULT_TRACES = ("addsub_codex002_n40.jsonl", "gsm8k_qwen3_4b_n8.jsonl", "svamp_pot_codex002_n30.jsonl")
PROJECTED_BATCHES = (16, 64, 128)
SWEEP_K = (0, 1, 2, 3, 4, 6, 8)
DEFAULT_HOST_TIME = "results/host_time.jsonl"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m evals replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", help="trace files (default: the shared traces)")
    ap.add_argument("--methods", nargs="+", default=[m for m in METHODS if m not in DEVICE_METHODS],
                    choices=METHODS, help="default: all but the device-route emulations (device-lag*)")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens (the most any step drafts)")
    ap.add_argument("--scouts", type=int, nargs="+", default=[0], help="scout counts to run")
    ap.add_argument("--batches", type=int, nargs="+", default=list(PROJECTED_BATCHES),
                    help="batch sizes (rows) to replay at; each is projected at its own size")
    ap.add_argument("--limit", type=int, help="first N problems of each set")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: shared GPT-2)")
    ap.add_argument("--costs", default=shared_path("costs", "h200_qwen2.5-7b_step_ms.jsonl"))
    ap.add_argument("--host-time", default=DEFAULT_HOST_TIME,
                    help="host ms per step by batch size ({\"B\", \"host_ms\"} JSONL from "
                         "`python -m evals host-time`) for the async-aware projection; "
                         "'none' to leave that view out")
    ap.add_argument("--schedules", choices=("sweep", "fixed"), default="sweep",
                    help="ngram/suffix k per batch size: the best of a sweep, or --k everywhere")
    ap.add_argument("--sweep-k", type=int, nargs="+", default=list(SWEEP_K), help="k values swept")
    ap.add_argument("--tune-limit", type=int, default=100, help="problems of each set the sweep runs on")
    ap.add_argument("--suffix-min-prob", type=float, nargs="+", default=[0.1],
                    help="suffix_decoding_min_token_prob values swept (engine-wide, with the schedule)")
    ap.add_argument("--suffix-spec-factor", type=float, nargs="+", default=[1.0],
                    help="suffix_decoding_max_spec_factor values swept (engine-wide, with the schedule)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of the consensus methods at --repeat-batches (spread of drafter time)")
    ap.add_argument("--repeat-batches", type=int, nargs="+", default=[128])
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="consensus drafter option, e.g. min_prob=0.3 (repeatable)")
    ap.add_argument("--out", default="results/replay", help="output prefix (.json and .md)")
    ap.add_argument("--drafter-time-scale", type=float, default=1.0,
                    help="what-if: project with the measured drafter time times this (e.g. 0.5 for a "
                         "host CPU twice as fast as this one during the run)")
    ap.add_argument("--host-time-scale", type=float, default=1.0,
                    help="what-if: project with the host-time table's values times this")
    ap.add_argument("--costs-slope-scale", type=float, default=1.0,
                    help="what-if truth: the --costs table with each step's cost above one token "
                         "per row times this (drives the replay's clock and the projection)")
    ap.add_argument("--online", choices=("on", "off"), default="on",
                    help="consensus learns its step costs from a clock that the --costs table "
                         "drives (the prior is its cost_model option); off: fixed cost model")
    ap.add_argument("--from-json", metavar="FILE",
                    help="replay nothing: project the results of an earlier run's .json afresh "
                         "(e.g. on another --host-time or --costs table)")
    args = ap.parse_args(argv)
    if args.k < 1 or min(args.batches) < 1 or any(s < 0 for s in args.scouts):
        ap.error("--k and --batches must be >= 1 and --scouts >= 0")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    if args.tune_limit < 1 or args.repeats < 1:
        ap.error("--tune-limit and --repeats must be >= 1")
    if args.drafter_time_scale < 0 or args.host_time_scale < 0 or args.costs_slope_scale < 0:
        ap.error("--drafter-time-scale, --host-time-scale and --costs-slope-scale must be >= 0")
    if min(args.sweep_k) < 0 or max(args.sweep_k) > args.k:
        ap.error(f"--sweep-k values must be in 0..--k ({args.k})")
    return args


# ---------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------


def schedule_from_ks(ks: dict[int, int]) -> list[tuple[int, int, int]]:
    """vLLM ``num_speculative_tokens_per_batch_size`` giving each measured
    batch size its k: batch sizes up to the smallest get its k, each next
    range starts one above the previous size; vLLM carries the last k on."""
    out, start = [], 1
    for b in sorted(ks):
        out.append((start, b, int(ks[b])))
        start = b + 1
    return out


def describe_schedule(ks: dict[int, int]) -> str:
    return ", ".join(f"B{b}→" + (f"k{ks[b]}" if ks[b] else "off") for b in sorted(ks))


def pick_schedule(rows: list[dict], key: str = "speedup") -> dict:
    """Best k per batch size from sweep rows ``{"batch", "k", "params", key}``.

    Engine-wide settings (``params``: suffix's min_token_prob and spec factor
    hold for every batch size) are chosen together: the setting whose best
    per-batch speedups have the highest geometric mean. Ties go to the
    smaller k."""
    by_params: dict[str, list[dict]] = {}
    for r in rows:
        by_params.setdefault(json.dumps(r.get("params") or {}, sort_keys=True), []).append(r)
    best = None
    for params, group in by_params.items():
        ks, speedups = {}, {}
        for r in sorted(group, key=lambda r: (r["batch"], r["k"])):
            b = r["batch"]
            if b not in ks or r[key] > speedups[b]:
                ks[b], speedups[b] = r["k"], r[key]
        score = math.exp(sum(math.log(max(s, 1e-9)) for s in speedups.values()) / len(speedups))
        if best is None or score > best["score"]:
            best = {"params": json.loads(params), "k": ks, "speedup": speedups, "score": score}
    if best is None:
        raise ValueError("no sweep rows to pick a schedule from")
    best["schedule"] = schedule_from_ks(best["k"])
    best["text"] = describe_schedule(best["k"])
    return best


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------


class CpuTimed:
    """A drafter wrapped to time each call in process CPU time, which other
    processes on a shared machine do not inflate (replay() keeps wall time)."""

    def __init__(self, fn):
        self.fn = fn
        self.cpu_s = 0.0
        self.rows = 0
        self.per_call: list[float] = []

    def __call__(self, sampled, batch):
        t0 = time.process_time()
        out = self.fn(sampled, batch)
        dt = time.process_time() - t0
        self.cpu_s += dt
        self.rows += len(sampled)
        self.per_call.append(dt * 1e6 / max(len(sampled), 1))
        return out

    @property
    def us_per_row(self) -> float:
        return self.cpu_s * 1e6 / max(self.rows, 1)

    @property
    def median_us_per_row(self) -> float:
        s = sorted(self.per_call)
        return s[len(s) // 2] if s else 0.0


class LearningTrace:
    """How fast the proposer's learned step costs approach the truth: per
    verified step, the relative error of its predicted time for that step's
    rows and draft tokens (drafter time excluded), and of the predicted cost
    of its draft tokens."""

    WITHIN = 0.05

    def __init__(self, proposer, truth: StepCosts):
        self.proposer, self.truth = proposer, truth
        self.errors: list[float] = []
        self.slope_errors: list[float] = []
        self.sizes = truth.batch_sizes

    def __call__(self, stats) -> None:
        b, m = stats.step_rows[-1], stats.step_drafted[-1]
        costs = self.proposer.budget.costs if self.proposer.budget is not None else None
        if costs is None or b < 1:
            return
        t = costs.step_ms(b, max(m, b), drafter=False)
        bb = min(max(b, self.sizes[0]), self.sizes[-1])
        true_at = lambda q: self.truth.step_ms_between(bb, q)  # noqa: E731
        self.errors.append(abs(t[m] / true_at(1.0 + m / b) - 1.0))
        one_more = true_at(2.0) - true_at(1.0)  # one draft token per row
        if one_more > 0:
            self.slope_errors.append(abs((t[b] - t[0]) / one_more - 1.0))

    def summary(self) -> dict:
        def settled(errors):  # first step after which every error is within WITHIN
            bad = [i for i, e in enumerate(errors) if e > self.WITHIN]
            return (bad[-1] + 1 if bad else 0) if errors else None
        return {"steps": len(self.errors), "steps_to_5pct_step_time": settled(self.errors),
                "steps_to_5pct_draft_cost": settled(self.slope_errors),
                "final_step_time_error": round(self.errors[-1], 4) if self.errors else None,
                "median_draft_cost_error": round(float(sorted(self.slope_errors)[len(self.slope_errors) // 2]), 4)
                if self.slope_errors else None}


class Bench:
    def __init__(self, args, costs: StepCosts | None, host: HostTime | None):
        self.args = args
        self.costs = costs
        self.host = host
        self.options = parse_options(args.option)
        self.warmed: set[str] = set()

    def project(self, row: dict) -> dict:
        b, tau, d = row["batch"], row["tau"], row["drafts_per_step"]
        c = row["cpu_us_per_row"] * self.args.drafter_time_scale
        if row["method"] in DEVICE_METHODS:  # drafts on the device; host work off the critical path
            c = device_us_per_row(b)
        if self.costs is None or b not in self.costs.batch_sizes:
            return row
        none = row["method"] == "none"
        row["speedup"] = 1.0 if none else self.costs.speedup(b, tau, d, c)
        if not none:
            row["break_even_host_ms"] = break_even_host_ms(self.costs, b, tau, d, c)
        if self.host is not None:
            h = self.host.host_ms(b) * self.args.host_time_scale
            row["host_ms"] = h
            # no drafting runs with async scheduling: it is the baseline itself
            row["speedup_async"] = 1.0 if none else self.costs.speedup_async_aware(b, tau, d, c, h)
            row["speedup_both_sync"] = 1.0 if none else self.costs.speedup_both_sync(b, tau, d, c, h)
        return row

    def clock(self, method: str) -> VirtualClock | None:
        """The time consensus learns its step costs from: the cost table's."""
        if self.costs is None or self.args.online == "off" or method != "consensus":
            return None
        sizes = self.costs.batch_sizes
        return VirtualClock(lambda b, q: self.costs.step_ms_between(min(max(b, sizes[0]), sizes[-1]), q))

    def run(self, problems, name: str, method: str, batch: int, scouts: int = 0,
            schedule=None, suffix_options: dict | None = None, tag: str = "") -> dict:
        k = self.args.k
        max_len = max(len(p.prompt) + max(map(len, p.completions)) for p in problems) + k + 2

        def build(clock):
            return make_drafter(method, k, max_len, batch, self.options, schedule=schedule,
                                suffix_options=suffix_options, clock=clock)

        if method not in self.warmed:  # load compiled code before anything is timed
            clock = self.clock(method)
            replay(problems[:1], build(clock), method, k, batch, scouts, clock=clock)
            self.warmed.add(method)
        clock = self.clock(method)
        inner = build(clock)
        drafter = CpuTimed(inner)
        learning = LearningTrace(inner.proposer, self.costs) if clock is not None else None
        n_paths = sum(len(p.completions) for p in problems)
        desc = f"{name} B={batch} {method}{tag} S={scouts}"
        t0 = time.perf_counter()
        with tqdm(total=n_paths, desc=desc, leave=False, disable=not sys.stderr.isatty()) as bar:
            stats = replay(problems, drafter, method, k, batch, scouts, bar, clock=clock,
                           on_step=learning)
        print(f"  {desc}: tau {stats.tau:.2f}, {drafter.us_per_row:.1f} µs/row-step CPU "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        row = {"traces": name, "problems": len(problems), "batch": batch, **stats.summary(),
               "cpu_us_per_row": drafter.us_per_row, "cpu_median_us_per_row": drafter.median_us_per_row}
        if hasattr(inner, "route_stats"):
            row.update(inner.route_stats())
        if learning is not None:
            row["learning"] = learning.summary()
            row["cost_counters"] = {key: value for key, value in inner.proposer.counters().items()
                                    if key.startswith(("steps_", "explore", "cost_model"))}
        if schedule is not None:
            row["schedule"] = [list(e) for e in schedule]
        if suffix_options:
            row["suffix_options"] = suffix_options
        return self.project(row)

    def sweep(self, problems, name: str, method: str) -> list[dict]:
        """Fixed-k runs at each batch size: one row per (settings, batch, k)."""
        args = self.args
        settings = [{}]
        if method == "suffix":
            settings = [{"suffix_decoding_min_token_prob": p, "suffix_decoding_max_spec_factor": f}
                        for p in args.suffix_min_prob for f in args.suffix_spec_factor]
        rows = []
        for params in settings:
            for batch in args.batches:
                for k in sorted(set(args.sweep_k)):
                    schedule = [(1, batch, k)]
                    row = self.run(problems, name, method, batch, 0, schedule, params or None,
                                   tag=f" sweep k={k}" + (f" {params}" if params else ""))
                    row.update(k=k, params=params, sweep=True)
                    rows.append(row)
        return rows


def load_tables(args, quiet: bool = False) -> tuple[StepCosts | None, HostTime | None]:
    """The step-cost table and the host-time table (None where not given)."""
    costs = StepCosts.load(args.costs) if args.costs and os.path.exists(args.costs) else None
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


def reproject(args) -> tuple[list[dict], list[dict], dict]:
    """Results of an earlier run (``--from-json``), projected afresh on this
    run's ``--costs`` and ``--host-time``: nothing is replayed."""
    with open(args.from_json, encoding="utf-8") as f:
        saved = json.load(f)
    bench = Bench(args, *load_tables(args))
    strip = ("speedup", "speedup_async", "speedup_both_sync", "host_ms", "break_even_host_ms")
    results = [bench.project({k: v for k, v in r.items() if k not in strip}) for r in saved["results"]]
    sweeps = [bench.project({k: v for k, v in r.items() if k not in strip}) for r in saved.get("sweep", [])]
    tuned = {name: {m: {**p, "k": {int(b): k for b, k in p["k"].items()},
                        "speedup": {int(b): x for b, x in p["speedup"].items()}}
                    for m, p in by_method.items()}
             for name, by_method in saved.get("schedules", {}).items()}
    return results, sweeps, tuned


def run(args) -> tuple[list[dict], list[dict], dict]:
    """(results, sweep rows, tuned schedules by trace set and method)."""
    tokenizer = load_tokenizer(args.tokenizer)
    costs, host = load_tables(args)
    bench = Bench(args, costs, host)
    results, sweeps, tuned = [], [], {}
    for path in args.traces or [shared_path("traces", t) for t in DEFAULT_TRACES]:
        problems = load_problems(path, tokenizer, limit=args.limit)
        name = os.path.basename(path).removesuffix(".jsonl")
        tuned[name] = {}
        if args.schedules == "sweep" and costs is not None:
            tune = problems[:args.tune_limit]
            for method in (m for m in SCHEDULABLE if m in args.methods):
                rows = bench.sweep(tune, name, method)
                for r in rows:
                    r["tune_problems"] = len(tune)
                sweeps.extend(rows)
                tuned[name][method] = pick_schedule(rows)
                tuned[name][method]["tune_problems"] = len(tune)
        for batch in args.batches:
            for scouts in args.scouts:
                for method in args.methods:
                    if scouts and method == "none":
                        continue  # scouts change nothing without drafting
                    pick = tuned[name].get(method)
                    repeats = (args.repeats if method.startswith("consensus")
                               and batch in args.repeat_batches else 1)
                    for i in range(repeats):
                        row = bench.run(problems, name, method, batch, scouts,
                                        pick["schedule"] if pick else None,
                                        (pick["params"] or None) if pick else None,
                                        tag=f" run {i + 1}" if repeats > 1 else "")
                        row["run"] = i
                        if pick:
                            row["k_at_batch"] = pick["k"].get(batch)
                        results.append(row)
    return results, sweeps, tuned


def cpu_reference_s(n: int = 5_000_000) -> float:
    """CPU seconds of a fixed pure-Python loop: how fast this machine ran
    (every drafter time here scales with it; compare runs and machines by it)."""
    t0 = time.process_time()
    total = 0
    for i in range(n):
        total += i
    return time.process_time() - t0


def main(argv=None) -> int:
    args = parse_args(argv)
    reference = []
    try:
        if not args.from_json:
            reference.append(cpu_reference_s())
        results, sweeps, tuned = reproject(args) if args.from_json else run(args)
        if not args.from_json:
            reference.append(cpu_reference_s())
        host = load_tables(args, quiet=True)[1]
    except (TraceError, FileNotFoundError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"error: {e}. The ngram/suffix baselines need vLLM (and arctic-inference for suffix); "
              "install with `pip install -e .[cpu,bench]` or pass --methods consensus none.", file=sys.stderr)
        return 2
    table = markdown(results, tuned, host)
    sweep_table = sweep_markdown(sweeps)
    checks = targets(results)
    scales = [f"{what} × {x:g}" for what, x in (("drafter time", args.drafter_time_scale),
                                                ("host time", args.host_time_scale)) if x != 1.0]
    if scales:
        table = ("WHAT-IF projection: measured " + " and ".join(scales)
                 + " (not what was measured).\n\n" + table)
    if reference:
        table += ("\n\nCPU speed during the run: a fixed pure-Python loop (5M additions) took "
                  + " / ".join(f"{x:.2f}" for x in reference) + " s of CPU time before / after "
                  "(drafter times scale with it).")
    print(table)
    if sweep_table:
        print("\n" + sweep_table)
    if checks:
        print("\nTargets:\n" + "\n".join("- " + c for c in checks))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"args": vars(args), "cpu_reference_s": reference, "results": results, "sweep": sweeps,
                   "schedules": {n: {m: {k: v for k, v in p.items()} for m, p in t.items()}
                                 for n, t in tuned.items()}}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(table + "\n" + ("\n" + sweep_table + "\n" if sweep_table else "")
                + ("\nTargets:\n" + "\n".join("- " + c for c in checks) + "\n" if checks else ""))
    print(f"wrote {args.out}.json and {args.out}.md")
    return 0
