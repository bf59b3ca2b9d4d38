"""``python -m evals device-report``: the device route's replay runs as
markdown (each variant's tau and projected speedup; the table's size and
refresh cost against the lag's budget), and with ``--host-bench`` the host
part of the speculator timed per call on a trace file. The route and its
emulation: :mod:`evals.replay.device_drafters`."""

from __future__ import annotations

import os

import numpy as np

VARIANTS = (  # (method, label, the view that route runs under)
    ("consensus", "current route: consensus, sync, per-row budget", "speedup_async"),
    ("device-lag1", "device route, lag 1, fixed K, async kept", "speedup"),
    ("device-lag2", "device route, lag 2, fixed K, async kept", "speedup"),
    ("device-lag0", "(reference) device route, lag 0, fixed K", "speedup"),
    ("suffix", "vLLM suffix, best K (sync)", "speedup_async"),
)


def table(results: list[dict]) -> str:
    """Markdown: per trace set and batch size, each variant's τ, draft tokens
    per row-step and projected speedup in both views (bold: its own route's)."""
    lines = ["| traces | rows | variant | K | τ | draft tok / row-step | async kept (no host time) "
             "| host time charged |", "|" + "---|" * 8]
    for name in dict.fromkeys(r["traces"] for r in results):
        for batch in sorted({r["batch"] for r in results if r["traces"] == name}):
            for method, label, view in VARIANTS:
                r = next((r for r in results if r["traces"] == name and r["batch"] == batch
                          and r["method"] == method), None)
                if r is None:
                    continue
                k = r.get("k_at_batch", "–") if method != "consensus" else "per row"
                cells = [(f"**{r[v]:.2f}**" if v == view else f"{r[v]:.2f}") if v in r else "–"
                         for v in ("speedup", "speedup_async")]
                lines.append(f"| {name.split('_')[0]} | {batch} | {label} | {k} | {r['tau']:.2f} | "
                             f"{r['drafts_per_step']:.2f} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def table_costs(results: list[dict], costs=None) -> str:
    """Markdown: the device table's size and refresh per step, and the host's
    CPU time per step (measured here) against the lag's budget of GPU steps."""
    lines = ["| traces | rows | lag | K | hit rate | table entries | full refresh / step "
             "| changed contexts / step | host µs / step (feed + refresh) | lag × step ms |",
             "|" + "---|" * 10]
    for r in results:
        if "refresh_full_bytes" not in r or not r.get("k_at_batch"):
            continue  # the emulation's accounting (device-emul-lag*) only
        k, b = r["k_at_batch"], r["batch"]
        budget = f"{r['lag'] * costs.step_ms(b, 1 + k):.1f}" if costs is not None else "–"
        host = r["host_feed_us_per_call"] + r.get("host_refresh_us_per_call", 0.0)
        lines.append(f"| {r['traces'].split('_')[0]} | {b} | {r['lag']} | {k} | {r['hit_rate']:.2f} | "
                     f"{r['table_entries'] / 1e3:.0f}k | {r['refresh_full_bytes'] / 1e6:.2f} MB | "
                     f"{r['changed_contexts']:.0f} ({r['refresh_delta_bytes'] / 1e3:.0f} KB) | "
                     f"{host:.0f} | {budget} |")
    return "\n".join(lines)


class HostTimed:
    """The emulation's drafts with the speculator's host part beside it: a
    :class:`LaggedTries` fed the same tokens each call, its feed and delta
    timed in thread CPU time. What the host does per step on a GPU server,
    without the CPU standing in for the device (the gather) in between."""

    def __init__(self, emulation, lag: int):
        from consensus_spec.drafting.lagged import LaggedTries

        self.emulation = emulation
        self.tries = LaggedTries(lag, emulation.drafter.options)
        self.paths: dict[str, int] = {}
        self.times: list[tuple[float, float, float]] = []  # per call: feed and delta CPU, wall seconds

    def __call__(self, sampled, batch):
        import time

        tries, rows = self.tries, len(sampled)
        req_ids = list(batch.req_ids[:rows])
        tries.begin_call()
        for req in sorted(set(self.paths) - set(req_ids)):
            tries.leave(self.paths.pop(req))
        for i, req in enumerate(req_ids):
            if req not in self.paths:
                self.paths[req] = tries.add(batch.token_ids_cpu[i, :int(batch.num_prompt_tokens[i])])
        paths = np.fromiter((self.paths[r] for r in req_ids), np.int64, rows)
        counts = np.fromiter(map(len, sampled), np.int64, rows)
        tokens = np.zeros((rows, max(counts.max(initial=1), 1)), np.int32)
        for i, s in enumerate(sampled):
            tokens[i, :len(s)] = s
        tries.push(paths, tokens, counts)
        w0, t0 = time.perf_counter(), time.thread_time()
        fed = tries.advance()
        t1 = time.thread_time()
        if rows:
            tries.roots(paths)
        tries.delta(fed)
        self.times.append((t1 - t0, time.thread_time() - t1, time.perf_counter() - w0))
        return self.emulation(sampled, batch)


def host_bench(traces: str, rows: int, k: int, lag: int, limit: int, repeats: int,
               tokenizer: str | None = None) -> list[dict]:
    """Host time per call (feed + refresh) of the device route at ``rows``
    rows and a fixed K, per repeat: thread CPU time (median, p90, mean) and
    wall time (median, mean)."""
    from consensus_spec.drafting.drafter import DrafterOptions

    from ..traces import load_problems, load_tokenizer, max_len
    from .device_drafters import DeviceRouteDrafter
    from .engine import replay

    problems = load_problems(traces, load_tokenizer(tokenizer), limit=limit)
    out = []
    for r in range(repeats + 1):  # the first run compiles and warms up: not reported
        timed = HostTimed(DeviceRouteDrafter(lag, lambda n: k, DrafterOptions()), lag)
        replay(problems if r else problems[:2], timed, "device-host", k, rows)
        if not r:
            continue
        feed, delta, wall = np.array(timed.times).reshape(-1, 3).T * 1e6
        both = feed + delta
        out.append({"rows": rows, "k": k, "lag": lag, "calls": len(both), "max_len": max_len(problems, k),
                    "host_us_median": float(np.median(both)), "host_us_p90": float(np.percentile(both, 90)),
                    "host_us_mean": float(both.mean()), "wall_us_median": float(np.median(wall)),
                    "wall_us_mean": float(wall.mean()), "feed_us_median": float(np.median(feed)),
                    "refresh_us_median": float(np.median(delta))})
    return out


def main(argv=None) -> int:
    import argparse
    import json

    from .projection import DEFAULT_COSTS, StepCosts

    ap = argparse.ArgumentParser(prog="python -m evals device-report", description=table.__doc__)
    ap.add_argument("results", help="a .json from `python -m evals replay --methods ... device-lag1 ...`, "
                    "or with --host-bench a trace file")
    ap.add_argument("--costs", default=DEFAULT_COSTS)
    ap.add_argument("--host-bench", action="store_true", help="time the speculator's host part per "
                    "call (feed + table refresh) on the trace file, without the gather")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--lag", type=int, default=1)
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokenizer")
    args = ap.parse_args(argv)
    if args.host_bench:
        for rec in host_bench(args.results, args.rows, args.k, args.lag, args.limit, args.repeats,
                              args.tokenizer):
            print(json.dumps(rec))
        return 0
    with open(args.results, encoding="utf-8") as f:
        results = json.load(f)["results"]
    costs = (StepCosts.from_model("h200_7b") if args.costs == DEFAULT_COSTS
             and not os.path.exists(args.costs) else StepCosts.load(args.costs))
    print(table(results) + "\n\n" + table_costs(results, costs))
    return 0
