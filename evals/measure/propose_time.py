"""propose()'s host time per row-step, split by phase: the current code
against the previous one, in one run.

    python -m evals propose-time [--traces FILE ...] [--limit 100] [--rows 16 64 128 256 512]
                                 [--previous 5cc4525] [--repeats 3] [--out results/propose_time]

vLLM runs a custom proposer serially between model steps, so every
microsecond it takes is added to every step. Each trace set is replayed
through the consensus proposer as ``python -m evals replay`` replays it
(online step costs, on the H200 table's virtual clock), ``--repeats`` times
for the current code and for the code at ``--previous`` (imported beside
it: ``evals/measure/previous.py``), alternating which goes first. Per
propose() call: thread CPU time and wall time per row-step; each figure is
the median (or p99) over the calls of a run, and the range over repeats.

One more run of each code, instrumented, splits every call into
- row tracking: ``RowTracker.update`` and ``.accepted``;
- trie extension and drafting: the drafter's one compiled call, made as
  its two public halves here (``extend_from`` every row, room-making and
  attaching paths included, then ``draft`` every row: the same drafts);
- budget: ``DraftBudget``'s floor, the call that keeps draft lengths and
  what it observes (calibration, step costs, the guard);
- glue: the rest of propose() (the timers' own cost lands here too).
Each phase's median and p99 per row-step over the calls.

Last, both codes are driven in lock step on one deterministic clock, and
every call's drafts must be the same (exit status 1 if not).

A replay's calls follow each other with the caches warm; in an engine a forward
pass between two calls leaves them cold. ``--evict-mb N`` writes an N MB buffer
before each timed call, untimed, as a forward pass would (docs/host_time.md).
"""

from __future__ import annotations

import argparse
import functools
import gc
import inspect
import sys
import time

import numpy as np

from ..machine import loop_line, python_loop_ns
from ..options import add_option_arg, add_trace_args, fail, parse_options, trace_sets, write_results
from ..replay.drafters import make_drafter
from ..replay.engine import VirtualClock, replay
from ..replay.projection import DEFAULT_COSTS, StepCosts
from ..replay.replay import DEFAULT_TRACES
from ..traces import TraceError, load_problems, load_tokenizer, max_len
from .previous import PREVIOUS, load

PHASES = ("rows", "extend", "draft", "budget")
BUDGET_CALLS = ("floor", "__call__", "observe", "observe_step", "observe_throughput")


class Calls:
    """Per propose() call: rows, thread CPU and wall seconds, and with
    ``phases`` the CPU seconds of each phase within it."""

    def __init__(self, phases: bool, evict: np.ndarray | None = None):
        self.evict = evict  # written before each call: caches as cold as after a forward pass
        self.rows, self.cpu, self.wall = [], [], []
        self.phases = {p: [] for p in PHASES} if phases else None
        self.now = dict.fromkeys(PHASES, 0.0)

    def timed(self, fn, phase: str):
        def call(*args, **kwargs):
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[phase] += time.thread_time() - t
        return call

    def around(self, propose):
        def call(sampled, *args, **kwargs):
            self.now = dict.fromkeys(PHASES, 0.0)
            if self.evict is not None:
                self.evict += 1.0
            w, t = time.perf_counter(), time.thread_time()
            out = propose(sampled, *args, **kwargs)
            self.cpu.append(time.thread_time() - t)
            self.wall.append(time.perf_counter() - w)
            self.rows.append(len(sampled))
            if self.phases is not None:
                for p in PHASES:
                    self.phases[p].append(self.now[p])
            return out
        return call

    def per_row(self, seconds) -> np.ndarray:
        return np.asarray(seconds) * 1e6 / np.maximum(self.rows, 1)


class TimedBudget:
    """A proposer's budget with its per-step calls timed as the budget phase."""

    def __init__(self, budget, calls: Calls):
        self._budget = budget
        for name in BUDGET_CALLS:  # instance attributes, but __call__ (looked up on the type)
            setattr(self, "_call" if name == "__call__" else name,
                    calls.timed(getattr(budget, name), "budget"))

    def __getattr__(self, name):
        return getattr(self._budget, name)

    def __call__(self, *a):
        return self._call(*a)


def split_drafter(drafter, calls: Calls):
    """``drafter.extend_and_draft`` (one compiled call) as its two public
    halves, each timed: ``extend_from`` (room, attaching paths, extending
    the tries) and ``draft`` (the walks), the same drafts."""
    def extend_and_draft(paths, buffer, rows, begins, ends, max_tokens, min_prob=None):
        t = time.thread_time()
        drafter.extend_from(paths, buffer, rows, begins, ends)
        t1 = time.thread_time()
        calls.now["extend"] += t1 - t
        out = drafter.draft(paths, max_tokens, min_prob)
        calls.now["draft"] += time.thread_time() - t1
        return out
    return extend_and_draft


def splittable(package) -> bool:
    """Whether the code's drafter has the public halves the split times
    (2df8630's ``draft`` takes no ``min_prob``)."""
    draft = package.drafting.drafter.ConsensusDrafter.draft
    return "min_prob" in inspect.signature(draft).parameters


def instrument(proposer, calls: Calls) -> None:
    proposer.propose = calls.around(proposer.propose)
    if calls.phases is None:
        return
    proposer.rows.update = calls.timed(proposer.rows.update, "rows")
    proposer.rows.accepted = calls.timed(proposer.rows.accepted, "rows")
    proposer.drafter.extend_and_draft = split_drafter(proposer.drafter, calls)
    if proposer.budget is not None:
        proposer.budget = TimedBudget(proposer.budget, calls)


class Clock:
    """Deterministic time for the lock-step check: a fixed 10 µs per read
    and the cost table's time per verified step."""

    def __init__(self, step_ms):
        self.step_ms, self.now = step_ms, 0.0

    def __call__(self) -> float:
        self.now += 1e-5
        return self.now

    def step(self, rows: int, drafted: int) -> None:
        if rows:
            self.now += self.step_ms(rows, 1.0 + drafted / rows) / 1000.0


class Lockstep:
    """Both proposers on the same inputs; counts calls whose drafts differ."""

    def __init__(self, drafters):
        self.drafters = drafters
        self.clocks = [d.proposer.clock for d in drafters]
        self.calls = self.differ = 0

    def __call__(self, sampled, batch):
        out = [d(sampled, batch) for d in self.drafters]
        self.calls += 1
        self.differ += any(list(a) != list(b) for a, b in zip(out[0], out[1]))
        return out[0]

    def begin_call(self) -> None:
        pass

    end_call = begin_call

    def step(self, rows: int, drafted: int) -> None:
        for c in self.clocks:
            c.step(rows, drafted)


@functools.lru_cache(maxsize=2)
def evict_buffer(mb: int) -> np.ndarray | None:  # --evict-mb's buffer (one per size), or None
    return np.zeros(mb << 17) if mb else None  # 8-byte floats


def run_one(package, problems, rows: int, args, costs, phases: bool) -> dict:
    clock = VirtualClock(costs.step_ms_clamped)
    drafter = make_drafter("consensus", args.k, max_len(problems, args.k), rows, args.options,
                           clock=clock, package=package)
    calls = Calls(phases, evict_buffer(args.evict_mb))
    instrument(drafter.proposer, calls)
    stats = replay(problems, drafter, "consensus", args.k, rows, clock=clock)
    cpu, wall = calls.per_row(calls.cpu), calls.per_row(calls.wall)
    full = cpu[np.asarray(calls.rows) == rows]  # a full batch: the run's drained tail left out
    row = {"tau": stats.tau, "drafts_per_step": stats.drafts_per_step, "calls": len(cpu),
           "cpu_mean": float(np.sum(calls.cpu) * 1e6 / np.sum(calls.rows)),
           **quantiles("cpu", cpu), **quantiles("wall", wall), **quantiles("full", full)}
    if phases:
        glue = np.asarray(calls.cpu) - sum(np.asarray(calls.phases[p]) for p in PHASES)
        for name, secs in [*calls.phases.items(), ("glue", glue)]:
            row.update(quantiles(name, calls.per_row(secs)))
    return row


def quantiles(name: str, us: np.ndarray) -> dict:
    if not len(us):
        return {}
    return {f"{name}_median": float(np.median(us)), f"{name}_p99": float(np.percentile(us, 99))}


def lockstep(codes, problems, rows: int, args, costs) -> dict:
    drafters = [make_drafter("consensus", args.k, max_len(problems, args.k), rows, args.options,
                             clock=Clock(costs.step_ms_clamped), package=pkg)
                for pkg in codes.values()]
    check = Lockstep(drafters)
    replay(problems, check, "consensus", args.k, rows, clock=check)
    return {"calls": check.calls, "calls_differ": check.differ}


def spread(runs: list[dict], key: str) -> str:
    """Median of the runs' figures (range over the runs)."""
    v = sorted(r[key] for r in runs if key in r)
    if not v:
        return "-"
    return f"{np.median(v):.2f} ({v[0]:.2f}–{v[-1]:.2f})" if len(v) > 1 else f"{v[0]:.2f}"


def run(args) -> dict:
    costs = StepCosts.load(args.costs)
    import consensus_spec
    codes = {"previous": load(args.previous), "current": consensus_spec}
    tokenizer = load_tokenizer(args.tokenizer)
    results = []
    for name, path in trace_sets(args.traces, DEFAULT_TRACES):
        problems = load_problems(path, tokenizer, limit=args.limit, skip_bad=args.skip_bad_lines)
        gc.freeze()  # as vLLM's engine core after start-up: the traces are no garbage to scan
        for pkg in codes.values():  # compiled code loaded, caches warm
            run_one(pkg, problems[:1], max(args.rows), args, costs, False)
        for rows in args.rows:
            timed = {c: [] for c in codes}
            for r in range(args.repeats):
                for code in (list(codes) if r % 2 == 0 else list(codes)[::-1]):
                    timed[code].append(run_one(codes[code], problems, rows, args, costs, False))
            for code in codes:
                split = (run_one(codes[code], problems, rows, args, costs, True)
                         if splittable(codes[code]) else None)
                results.append({"traces": name, "rows": rows, "code": code, "runs": timed[code],
                                "split": split})
            check = lockstep(codes, problems, rows, args, costs)
            results[-1]["lockstep"] = results[-2]["lockstep"] = check
            print(f"  {name} {rows} rows: current {spread(timed['current'], 'cpu_median')} µs, "
                  f"previous {spread(timed['previous'], 'cpu_median')} µs per row-step (CPU, "
                  f"median); drafts differ in {check['calls_differ']} of {check['calls']} calls",
                  file=sys.stderr, flush=True)
    return {"results": results, "previous": codes["previous"].__name__}


def markdown(data: dict, reference: list[float]) -> str:
    results = data["results"]
    lines = [f"propose() per row-step, CPU µs unless said: current code vs {data['previous']}; "
             "each figure the median over a run's calls (p99: its 99th percentile), then the "
             "median (range) over the repeats. Full batch: calls with every row in use (a run's "
             "tail, where the batch drains, left out).", "",
             "| traces | rows | code | median | p99 | full batch median | full batch p99 "
             "| wall median | wall p99 | τ | same drafts |", "|" + "---|" * 11]
    for r in results:
        runs, lock = r["runs"], r["lockstep"]
        same = "yes" if not lock["calls_differ"] else f"NO ({lock['calls_differ']} calls)"
        cells = [spread(runs, k) for k in ("cpu_median", "cpu_p99", "full_median", "full_p99",
                                           "wall_median", "wall_p99", "tau")]
        lines.append(f"| {short(r['traces'])} | {r['rows']} | {r['code']} | " + " | ".join(cells)
                     + f" | {same} ({lock['calls']} calls) |")
    lines += ["", "Split, one instrumented run of each: median / p99 per row-step of each phase "
              "(the timers' cost is in glue; the instrumented total beside).", "",
              "| traces | rows | code | " + " | ".join(NAMES[p] for p in (*PHASES, "glue"))
              + " | instrumented total |", "|" + "---|" * 9]
    for r in results:
        s = r["split"]
        if s is None:
            lines.append(f"| {short(r['traces'])} | {r['rows']} | {r['code']} | "
                         "no split: its drafter lacks the public halves (`splittable`) |")
            continue
        lines.append(f"| {short(r['traces'])} | {r['rows']} | {r['code']} | "
                     + " | ".join(f"{s[p + '_median']:.2f} / {s[p + '_p99']:.1f}"
                                  for p in (*PHASES, "glue"))
                     + f" | {s['cpu_median']:.2f} / {s['cpu_p99']:.1f} |")
    by = {(r["traces"], r["rows"], r["code"]): r["runs"] for r in results}
    median = lambda runs: float(np.median([x["cpu_median"] for x in runs]))  # noqa: E731
    lines += ["", "Previous / current, median per row-step: " + ", ".join(
        f"{short(t)} {b} rows {median(by[t, b, 'previous']) / median(by[t, b, 'current']):.2f}x"
        for t, b, c in by if c == "current")]
    lines.append("\n" + loop_line(*reference))
    return "\n".join(lines)


NAMES = {"rows": "row tracking", "extend": "trie extension", "draft": "drafting",
         "budget": "budget", "glue": "glue"}


def short(traces: str) -> str:
    return traces.split("_")[0]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m evals propose-time",
                                 description=__doc__.split("\n\n")[0])
    add_trace_args(ap)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256, 512], help="batch sizes")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs of each code per set and batch size")
    ap.add_argument("--previous", default=PREVIOUS,
                    help="git revision of the code compared against")
    ap.add_argument("--costs", default=DEFAULT_COSTS,
                    help="step-cost table the virtual clock runs on")
    ap.add_argument("--evict-mb", type=int, default=0,
                    help="write this many MB before each timed call, untimed: caches as cold "
                         "as an engine's forward pass leaves them (0: warm)")
    add_option_arg(ap)
    ap.add_argument("--out", default="results/propose_time", help="output prefix (.json and .md)")
    args = ap.parse_args(argv)
    if min(args.rows) < 1 or args.k < 1 or args.repeats < 1 or (args.limit or 1) < 1 \
            or not 0 <= args.evict_mb <= 4096:
        ap.error("--rows, --k, --repeats and --limit must be >= 1, --evict-mb within 0..4096")
    args.options = parse_options(args.option)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        reference = [python_loop_ns()]
        data = run(args)
        reference.append(python_loop_ns())
    except (TraceError, ValueError) as e:
        return fail(e)
    text = markdown(data, reference)
    print(text)
    write_results(args.out, {"args": vars(args), "python_loop_ns": reference, **data}, text)
    return 0 if not any(r["lockstep"]["calls_differ"] for r in data["results"]) else 1
