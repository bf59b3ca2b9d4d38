"""What one replay run is: a drafter built, timed in CPU time and replayed at
a batch size, its row projected on the step-cost and host-time tables; and
how a sweep over k picks the per-batch-size schedule the baselines run with;
and RL rollout batches run whole (``--admission fixed``).
``python -m evals replay`` (``evals/replay/replay.py``) drives it; the waves
replay reuses its timing and tables."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

import numpy as np
from tqdm import tqdm

from consensus_spec.budget import cost_model
from ..options import parse_options
from ..traces import max_len
from .device_drafters import device_us_per_row
from .drafters import DEVICE_METHODS, make_drafter, schedule_lookup
from .engine import Queued, VirtualClock, replay
from .projection import HostTime, StepCosts, break_even_host_ms, for_run, run_ms

MIN_STEADY_STEPS = 20  # steady steps a projection at that batch size needs (else: every step)
TAIL_SHARE = 0.9  # --admission fixed: the tail starts when a batch has this share of its tokens


def pick_schedule(rows: list[dict], key: str = "speedup") -> dict:
    """Best k per batch size from sweep rows ``{"batch", "k", "params", key}``.

    Engine-wide settings (``params``: suffix's min_token_prob and spec factor
    hold for every batch size) are chosen together: the setting whose best
    per-batch speedups have the highest geometric mean. Ties go to the
    smaller k.  The schedule (vLLM's ``num_speculative_tokens_per_batch_size``)
    gives batch sizes up to the smallest measured one its k, each next range
    starting one above the previous size; vLLM carries the last k on."""
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
    sizes = sorted(best["k"])
    best["schedule"] = [(lo, b, int(best["k"][b])) for lo, b in zip([1] + [b + 1 for b in sizes], sizes)]
    best["text"] = ", ".join(f"B{b}→" + (f"k{best['k'][b]}" if best["k"][b] else "off") for b in sizes)
    return best


class CpuTimed:
    """A drafter wrapped to time each call in process CPU time, which other
    processes on a shared machine do not inflate (replay() keeps wall time);
    with ``log``, each call's rows and the draft lengths it returned are noted."""

    def __init__(self, fn, log: bool = False):
        self.fn = fn
        self.cpu_s = 0.0
        self.rows = 0
        self.call_s: list[float] = []    # CPU seconds per call
        self.per_call: list[float] = []  # and per row, in µs
        self.call_rows: list[int] = []   # rows of each call
        self.calls: list[list] | None = [] if log else None

    def __call__(self, sampled, batch):
        t0 = time.process_time()
        out = self.fn(sampled, batch)
        dt = time.process_time() - t0
        self.cpu_s += dt
        self.rows += len(sampled)
        self.call_s.append(dt)
        self.per_call.append(dt * 1e6 / max(len(sampled), 1))
        self.call_rows.append(len(sampled))
        if self.calls is not None:
            self.calls.append([len(sampled), sorted({len(d) for d in out})])
        return out

    @property
    def us_per_row(self) -> float:
        return self.cpu_s * 1e6 / max(self.rows, 1)

    @property
    def median_us_per_row(self) -> float:
        s = sorted(self.per_call)
        return s[len(s) // 2] if s else 0.0

    def percentiles(self, rows: int | None = None) -> dict:
        """Median and p99 over calls of CPU µs per row-step; with ``rows``,
        over the calls with that many rows only (a full batch: the tail of
        a run, where the batch drains to a few rows, left out)."""
        per = [x for x, n in zip(self.per_call, self.call_rows) if rows is None or n == rows]
        if not per:
            return {}
        return {"median": float(np.median(per)), "p99": float(np.percentile(per, 99)), "calls": len(per)}


class Bench:
    def __init__(self, args, costs: StepCosts | None, host: HostTime | None):
        self.args = args
        self.costs = costs
        self.host = host
        self.options = parse_options(args.option)
        self.warmed: set[str] = set()
        self._truth: str | None = None  # consensus-truth's cost model (truth_table)
        self._prior: str | None = None  # consensus's what-if prior (prior_table)

    def project(self, row: dict) -> dict:
        """The projected speedup at the row's batch size, from the steps run
        while paths still waited to enter (``steady``): a run's draining tail
        drafts at smaller, cheaper batches, and priced at the full batch's
        step cost it would count against drafting. Rows without enough such
        steps (or saved before they were kept) use every step;
        ``projected_over`` says which."""
        b = row["batch"]
        steady = row.get("steady") or {}
        if steady.get("steps", 0) >= MIN_STEADY_STEPS:
            tau, d, c, row["projected_over"] = (steady["tau"], steady["drafts_per_step"],
                                                steady["cpu_us_per_row"], "steady steps")
        else:
            tau, d, c, row["projected_over"] = (row["tau"], row["drafts_per_step"],
                                                row["cpu_us_per_row"], "all steps")
        c *= self.args.drafter_time_scale
        if row["method"] in DEVICE_METHODS:  # drafts on the device; host work off the critical path
            c = device_us_per_row(b)
        if self.costs is None or b not in self.costs.batch_sizes:
            return row
        none = row["method"] == "none"
        row["speedup"] = 1.0 if none else self.costs.speedup(b, tau, d, c)
        if not none:
            row["break_even_host_ms"] = break_even_host_ms(self.costs, b, tau, d, c)
        if self.host is not None:
            h = self.host.host_ms(b)
            row["host_ms"] = h
            # no drafting runs with async scheduling: it is the baseline itself
            row["speedup_async"] = 1.0 if none else self.costs.speedup(b, tau, d, c, h, async_base=True)
            row["speedup_both_sync"] = 1.0 if none else self.costs.speedup(b, tau, d, c, h)
        return row

    def truth_table(self) -> str:
        """The projected-on table as a file a budget takes as its cost model."""
        if self.costs is None:
            raise ValueError("consensus-truth needs a --costs table")
        if self._truth is None:
            self._truth = self.costs.to_file("replay_truth_")
        return self._truth

    def prior_table(self) -> str | None:
        """With ``--prior-scale`` S: the H200 model with its compute cost per token
        times S (a prior S times off), as a table consensus takes as its cost model."""
        scale = getattr(self.args, "prior_scale", 1.0)
        if scale == 1.0:
            return None
        if self._prior is None:
            h200 = cost_model("h200_7b")
            model = dataclasses.replace(h200, ms_per_token=h200.ms_per_token * scale)
            self._prior = StepCosts.from_model(model).to_file("replay_prior_")
        return self._prior

    def clock(self, method: str) -> VirtualClock | None:
        """The time consensus learns its step costs from: the cost table's."""
        if self.costs is None or self.args.online == "off" or method != "consensus":
            return None
        return VirtualClock(self.costs.step_ms_clamped)

    def builder(self, problems, method: str, batch: int, scouts: int = 0, schedule=None,
                suffix_options: dict | None = None):
        """``build(clock, memory=None)``: ``method``'s drafter for ``problems`` at ``batch``
        rows; the first for a method replays one problem untimed (compiled code loaded)."""
        k = self.args.k

        def build(clock, memory=None):
            options = {**self.options, **memory.options} if memory else self.options
            if method == "consensus-truth":
                options = {**options, "cost_model": self.truth_table()}
            elif method == "consensus" and self.prior_table():
                options = {**options, "cost_model": self.prior_table()}
            return make_drafter(method, k, max_len(problems, k), batch, options, schedule=schedule,
                                suffix_options=suffix_options, clock=clock,
                                model=memory.model if memory else None)

        if method not in self.warmed:
            clock = self.clock(method)
            replay(problems[:1], build(clock), method, k, batch, scouts, clock=clock)
            self.warmed.add(method)
        return build

    def run(self, problems, name: str, method: str, batch: int, scouts: int = 0,
            schedule=None, suffix_options: dict | None = None, tag: str = "") -> dict:
        k = self.args.k
        build = self.builder(problems, method, batch, scouts, schedule, suffix_options)
        clock = self.clock(method)
        memory = for_run(self.args, self.costs, method, clock, name, batch, tag)
        inner = build(clock, memory)
        drafter = CpuTimed(inner, log=getattr(self.args, "step_log", False))
        n_paths = sum(len(p.completions) for p in problems)
        desc = f"{name} B={batch} {method}{tag} S={scouts}"
        t0 = time.perf_counter()
        with tqdm(total=n_paths, desc=desc, leave=False, disable=not sys.stderr.isatty()) as bar:
            stats = replay(problems, drafter, method, k, batch, scouts, bar, clock=clock)
        print(f"  {desc}: tau {stats.tau:.2f}, {drafter.us_per_row:.1f} µs/row-step CPU "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        steady = stats.steady()
        steady_calls = drafter.call_s[:steady["steps"]]
        row = {"traces": name, "problems": len(problems), "batch": batch, **stats.summary(),
               "cpu_us_per_row": drafter.us_per_row, "cpu_median_us_per_row": drafter.median_us_per_row,
               "cpu_p99_us_per_row": drafter.percentiles().get("p99", 0.0),
               "cpu_full_batch_us_per_row": drafter.percentiles(batch),
               "steady": {**steady, "cpu_us_per_row": sum(steady_calls) * 1e6
                          / max(sum(drafter.call_rows[:steady["steps"]]), 1)}}
        if self.costs is not None:  # the whole run, step by step (replay() pairs it with none's)
            row["run_ms"] = (run_ms(self.costs, stats.step_rows, stats.step_drafted)
                             + drafter.cpu_s * 1000.0 * self.args.drafter_time_scale * (method != "none"))
        if hasattr(inner, "route_stats"):
            row.update(inner.route_stats())
        if hasattr(inner, "budget_stats"):  # suffix-budget and consensus*: the budget's state
            row["budget"] = inner.budget_stats()
        if clock is not None:  # consensus learning its step costs
            row["cost_counters"] = {key: value for key, value in inner.proposer.counters().items()
                                    if key.startswith(("steps_", "step_costs", "explore", "cost_model", "guard",
                                                       "learning"))}
        if memory is not None:
            row["step_cost_memory"] = memory.finish(inner.proposer)
        if drafter.calls is not None:
            row["calls"] = drafter.calls
            row["steps"] = [[b, m] for b, m in zip(stats.step_rows, stats.step_drafted)]
        if schedule is not None:
            row["schedule"] = [list(e) for e in schedule]
            row["k_by_rows"] = schedule_lookup(schedule, batch, k)  # the scheduled k at 0..batch rows
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

    def run_fixed(self, problems, name: str, method: str, rows: int, group: int | None = None,
                  schedule=None, suffix_options: dict | None = None) -> dict:
        """``--admission fixed``: RL rollout batches of G (``group``, default the
        set's smallest path count) paths of P = rows // G problems, each admitted
        whole and run to its last token, projected step by step; a last batch
        short of P problems is left out, one drafter serves every batch.  A step
        costs ``T(B, 1 + d/B)`` plus the drafter's CPU time of that step
        (``run_ms``; no drafting: ``T(B, 1)``).  The makespan sums the batches'
        projected times, the tail their times from the step that brought the
        batch to 90% of its tokens to its end (docs/rollouts.md)."""
        problems, g, chunks = batches_of(problems, rows, group)
        if not chunks:
            raise ValueError(f"{name}: fewer than {rows // g} problems for one batch of {rows} rows")
        k, costs, scale = self.args.k, self.costs, self.args.drafter_time_scale
        build = self.builder(problems, method, rows, schedule=schedule, suffix_options=suffix_options)
        clock = self.clock(method)
        drafter = CpuTimed(build(clock))
        makespan = tail = 0.0
        tokens = row_steps = drafted = accepted = 0
        after_tokens = after_rows = 0
        t0 = time.perf_counter()
        for chunk in chunks:
            done: list[int] = []  # tokens so far, per step
            first_call = len(drafter.call_s)
            batch = Queued((p, s) for p in chunk for s in range(g))
            stats = replay(problems, drafter, method, k, rows, admission=batch, clock=clock,
                           on_step=lambda s: done.append(s.tokens))
            t, prev, done_at, full = 0.0, 0, None, stats.step_rows[0]
            calls = drafter.call_s[first_call:]
            for b, d, cum, call_s in zip(stats.step_rows, stats.step_drafted, done, calls):
                t += run_ms(costs, [b], [d], [call_s * 1000.0 * scale] if method != "none" else None)
                if done_at is None and cum >= TAIL_SHARE * stats.tokens:
                    done_at = t
                if b < full:  # rows have left: the batch is draining
                    after_tokens += cum - prev
                    after_rows += b
                prev = cum
            makespan += t
            tail += t - done_at
            tokens += stats.tokens
            row_steps += stats.row_steps
            drafted += stats.drafted
            accepted += stats.accepted
        print(f"  {name} fixed batch {rows} ({len(chunks)} x {rows // g} problems x {g}) {method}: "
              f"{makespan / 1000:.2f} s projected ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
        return {"traces": name, "method": method, "admission": "fixed", "batch": rows, "group": g,
                "prompts_per_batch": rows // g, "batches": len(chunks), "makespan_ms": makespan,
                "tail_ms": tail, "tail_share": TAIL_SHARE, "tokens": tokens, "row_steps": row_steps,
                "tau": tokens / max(row_steps, 1), "tau_after_drain": after_tokens / max(after_rows, 1),
                "drafts_per_step": drafted / max(row_steps, 1), "acceptance": accepted / max(drafted, 1),
                "cpu_us_per_row": drafter.us_per_row,
                "schedule": [list(e) for e in schedule] if schedule else None,
                "suffix_options": suffix_options}


def batches_of(problems, rows: int, group: int | None):
    """(problems cut to G paths each, G, [[problem index, ...] per batch])."""
    g = group or min(len(p.completions) for p in problems)
    if g > rows or any(len(p.completions) < g for p in problems):
        raise ValueError(f"--group {g}: needs <= --batches rows and that many paths in every problem")
    cut = [dataclasses.replace(p, completions=p.completions[:g]) for p in problems]
    per = rows // g
    return cut, g, [list(range(i, i + per)) for i in range(0, len(cut) - per + 1, per)]
