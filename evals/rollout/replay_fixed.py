"""``python -m evals replay --admission fixed``: rollout batches replayed, each
projected step by step on the step-cost table; docs/rollouts.md says how
batches are cut, admitted and projected.

G (``--group``) defaults to the set's smallest path count; a last batch short
of P = rows // G problems is left out; one drafter serves every batch (request
ids stay unique).  A step costs ``T(B, 1 + d/B)`` plus the drafter's CPU time
of that step (``evals/replay/projection.py``, ``run_ms``); no drafting pays
``T(B, 1)``.  The makespan sums the batches' projected times, the tail their
times from the step that brought the batch to 90% of its tokens to its end.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from ..replay.bench import CpuTimed
from ..replay.engine import Queued, replay
from ..replay.projection import run_ms

TAIL_SHARE = 0.9


def batches_of(problems, rows: int, group: int | None):
    """(problems cut to G paths each, G, [[problem index, ...] per batch])."""
    g = group or min(len(p.completions) for p in problems)
    if g > rows or any(len(p.completions) < g for p in problems):
        raise ValueError(f"--group {g}: needs <= --batches rows and that many paths in every problem")
    cut = [dataclasses.replace(p, completions=p.completions[:g]) for p in problems]
    per = rows // g
    return cut, g, [list(range(i, i + per)) for i in range(0, len(cut) - per + 1, per)]


def run_fixed(bench, problems, name: str, method: str, rows: int, group: int | None = None,
              schedule=None, suffix_options: dict | None = None) -> dict:
    problems, g, chunks = batches_of(problems, rows, group)
    if not chunks:
        raise ValueError(f"{name}: fewer than {rows // g} problems for one batch of {rows} rows")
    k, costs, scale = bench.args.k, bench.costs, bench.args.drafter_time_scale
    build = bench.builder(problems, method, rows, schedule=schedule, suffix_options=suffix_options)
    clock = bench.clock(method)
    drafter = CpuTimed(build(clock))
    makespan = tail = 0.0
    tokens = row_steps = drafted = accepted = 0
    after_tokens = after_rows = 0
    t0 = time.perf_counter()
    for chunk in chunks:
        done: list[int] = []  # tokens so far, per step
        first_call = len(drafter.call_s)
        stats = replay(problems, drafter, method, k, rows, admission=Queued(
            (p, s) for p in chunk for s in range(g)), clock=clock, on_step=lambda s: done.append(s.tokens))
        t, prev, done_at, full = 0.0, 0, None, stats.step_rows[0]
        for b, d, cum, call_s in zip(stats.step_rows, stats.step_drafted, done, drafter.call_s[first_call:]):
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
          f"{makespan / 1000:.2f} s projected ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return {"traces": name, "method": method, "admission": "fixed", "batch": rows, "group": g,
            "prompts_per_batch": rows // g, "batches": len(chunks), "makespan_ms": makespan,
            "tail_ms": tail, "tail_share": TAIL_SHARE, "tokens": tokens, "row_steps": row_steps,
            "tau": tokens / max(row_steps, 1), "tau_after_drain": after_tokens / max(after_rows, 1),
            "drafts_per_step": drafted / max(row_steps, 1), "acceptance": accepted / max(drafted, 1),
            "cpu_us_per_row": drafter.us_per_row,
            "schedule": [list(e) for e in schedule] if schedule else None,
            "suffix_options": suffix_options}


def markdown(results: list[dict]) -> str:
    """One table per trace set: makespan and tail against no drafting."""
    out = ["PROJECTED on the H200 step-cost table (replayed traces, drafter CPU time measured "
           "here; prefill and host time left out): fixed rollout batches, all rows admitted at "
           "once, no refill, run to the last token."]
    for name, rows in dict.fromkeys((r["traces"], r["batch"]) for r in results):
        rs = [r for r in results if (r["traces"], r["batch"]) == (name, rows)]
        base = next((r for r in rs if r["method"] == "none"), None)
        r0 = rs[0]
        out += ["", f"**{name}**: {r0['batches']} batches of {r0['prompts_per_batch']} prompts x "
                    f"{r0['group']} paths ({r0['batch']} rows)", "",
                "| method | makespan s | × none | tail s (90→100% tokens) | × none | τ | τ draining | "
                "drafts/row-step | drafter µs/row |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rs:
            x = base["makespan_ms"] / r["makespan_ms"] if base else None
            xt = base["tail_ms"] / r["tail_ms"] if base and r["tail_ms"] else None
            out.append(f"| {r['method']} | {r['makespan_ms'] / 1000:.2f} | "
                       f"{'–' if x is None else f'{x:.2f}×'} | {r['tail_ms'] / 1000:.2f} | "
                       f"{'–' if xt is None else f'{xt:.2f}×'} | {r['tau']:.2f} | "
                       f"{r['tau_after_drain']:.2f} | {r['drafts_per_step']:.2f} | {r['cpu_us_per_row']:.1f} |")
    return "\n".join(out)
