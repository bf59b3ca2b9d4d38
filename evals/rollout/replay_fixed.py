"""``python -m evals replay --admission fixed``: rollout batches replayed.

A trace set is cut into rollout batches of P = rows // G problems x their
first G recorded paths (G: ``--group``, default the set's smallest path
count).  Each batch is admitted whole after prefill, nothing refills it, and
it runs to its last token, as a trainer's rollout batch does; the next batch
follows with the same drafter (an engine between trainer steps; request ids
stay unique).  A last batch short of P problems is left out.

Each step is projected on the step-cost table like the rest of the replay,
step by step (``evals/replay/projection.py``, ``run_ms``): ``T(B, 1 + d/B)`` at
that step's B rows and d draft tokens, plus the drafter's CPU time of that
step measured here (serial in vLLM); no drafting pays ``T(B, 1)``.  Prefill
and host time are left out.  The makespan is the sum of the batches'
projected times, the tail the sum of their times from the step that brought
the batch to 90% of its tokens to its end.  A projection on the H200 table,
not a GPU measurement.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import deque

from ..replay.drafters import make_drafter
from ..replay.engine import replay
from ..replay.projection import run_ms

TAIL_SHARE = 0.9


class FixedBatch:
    """Admission: these paths, all at once; nothing after them."""

    def __init__(self, keys):
        self.queue = deque(keys)

    def pop(self):
        return self.queue.popleft() if self.queue else None

    def finished(self, problem: int, path: int) -> None:
        return None


class CallCpu:
    """The drafter, each call's process CPU seconds noted."""

    def __init__(self, fn):
        self.fn, self.calls, self.rows = fn, [], 0

    def __call__(self, sampled, batch):
        t0 = time.process_time()
        out = self.fn(sampled, batch)
        self.calls.append(time.process_time() - t0)
        self.rows += len(sampled)
        return out


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
    k, costs = bench.args.k, bench.costs
    max_len = max(len(p.prompt) + max(map(len, p.completions)) for p in problems) + k + 2

    def build(clock):
        return make_drafter(method, k, max_len, rows, bench.options, schedule=schedule,
                            suffix_options=suffix_options, clock=clock)

    if method not in bench.warmed:  # compiled code loaded before anything is timed
        clock = bench.clock(method)
        replay(problems[:1], build(clock), method, k, rows, clock=clock)
        bench.warmed.add(method)
    clock = bench.clock(method)
    drafter = CallCpu(build(clock))
    scale = bench.args.drafter_time_scale
    makespan = tail = 0.0
    tokens = row_steps = drafted = accepted = 0
    after_tokens = after_rows = 0
    t0 = time.perf_counter()
    for chunk in chunks:
        steps: list[tuple[int, int, int]] = []  # (rows, drafted, tokens so far) per step
        first_call = len(drafter.calls)
        on_step = lambda s: steps.append((s.step_rows[-1], s.step_drafted[-1], s.tokens))  # noqa: E731
        stats = replay(problems, drafter, method, k, rows, admission=FixedBatch(
            (p, s) for p in chunk for s in range(g)), clock=clock, on_step=on_step)
        calls = drafter.calls[first_call:]
        times, done_at = [], None
        for i, (b, d, _) in enumerate(steps):
            c = [calls[i] * 1000.0 * scale] if method != "none" else None
            times.append(run_ms(costs, [b], [d], c))
        total, t, prev, full = stats.tokens, 0.0, 0, steps[0][0]
        for i, (b, d, cum) in enumerate(steps):
            t += times[i]
            if done_at is None and cum >= TAIL_SHARE * total:
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
            "cpu_us_per_row": sum(drafter.calls) * 1e6 / max(drafter.rows, 1),
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
