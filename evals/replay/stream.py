"""Long-run memory and quality check: many millions of tokens through one
consensus proposer, as a long-lived vLLM engine would see them.

    python -m evals stream [--tokens 20000000] [--max-trie-nodes N] [--out FILE.json]

The shared traces are replayed (128 rows, k=8) pass after pass through ONE
proposer, so its tries fill up and get evicted. Each pass shuffles the
problems (every window then mixes all trace sets alike, so tau is comparable
across windows) and puts a pass-specific token before every prompt, so no
pass finds an earlier pass's sibling groups. Per window of generated tokens
it reports tau, drafter time, evictions, trie nodes, array bytes and process
RSS, and checks that no window right after an eviction has tau more than 5%
below the window before it. Prints a markdown table; exits 1 if the check
fails or a drafting step failed.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import itertools
import random
import resource
import sys
import time

import numpy as np

from consensus_spec import DrafterOptions

from ..options import fail, trace_sets, write_json
from ..traces import Problem, TraceError, load_problems, load_tokenizer, max_len
from .drafters import make_drafter
from .engine import replay
from .replay import DEFAULT_TRACES

PASS_TOKEN = 50257  # first id past GPT-2's vocabulary: pass p's prompts start with PASS_TOKEN + p
MAX_DROP = 0.05     # allowed tau drop after an eviction


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def timed(fn, cpu_clock, out: list):
    """``fn`` wrapped to append each call's (wall, ``cpu_clock``) seconds to ``out``."""
    def call(*args, **kwargs):
        t, cpu = time.perf_counter(), cpu_clock()
        result = fn(*args, **kwargs)
        out.append((time.perf_counter() - t, cpu_clock() - cpu))
        return result
    return call


def eviction_times(drafter) -> dict:
    """The drafter's rotations: mean and longest wall ms, mean CPU ms."""
    n = max(drafter.evictions, 1)
    return {"eviction_ms_mean": 1e3 * drafter.eviction_s / n,
            "eviction_ms_max": 1e3 * drafter.eviction_max_s,
            "eviction_cpu_ms_mean": 1e3 * drafter.eviction_cpu_s / n}


class Monitor:
    """``replay``'s per-step hook: cuts the run into windows of generated tokens."""

    def __init__(self, proposer, window: int):
        self.proposer, self.window = proposer, window
        self.base = {"tokens": 0, "row_steps": 0, "propose_s": 0.0, "propose_rows": 0}
        self.start = dict(self.base)
        self.windows: list[dict] = []
        self.peak_nodes = self.peak_bytes = self.peak_capacity = 0
        self.window_peak = 0
        self.t0 = time.perf_counter()
        self._last_counters = self.counters()
        self.arena_bytes = proposer.drafter.forest.nbytes
        self.arena_changes = 0
        self.calls: list[tuple[float, float]] = []  # (wall, thread CPU) seconds per propose() call
        proposer.propose = timed(proposer.propose, time.thread_time, self.calls)

    def counters(self) -> dict:
        d = self.proposer.drafter
        return {k: getattr(d, k) for k in ("evictions", "groups_evicted", "live_groups_evicted",
                                            "nodes_evicted")}

    def end_pass(self, stats) -> None:
        for k in self.base:
            self.base[k] += getattr(stats, k)

    def __call__(self, stats) -> None:
        forest = self.proposer.drafter.forest
        nodes = forest.num_nodes()
        self.window_peak = max(self.window_peak, nodes)
        self.peak_nodes = max(self.peak_nodes, nodes)
        self.peak_bytes = max(self.peak_bytes, forest.nbytes)
        self.peak_capacity = max(self.peak_capacity, len(forest.arena()[0]))
        if forest.nbytes != self.arena_bytes:
            self.arena_changes += 1  # the arrays were reallocated: there should be none
        now = {k: self.base[k] + getattr(stats, k) for k in self.base}
        if now["tokens"] - self.start["tokens"] >= self.window:
            self.close(now)

    def close(self, now: dict) -> None:
        if now["row_steps"] == self.start["row_steps"]:
            return
        partial = now["tokens"] - self.start["tokens"] < self.window  # the run's last
        d = self.proposer.drafter
        counters = self.counters()
        delta = {k: counters[k] - self._last_counters[k] for k in counters}
        diff = {k: now[k] - self.start[k] for k in now}
        self.windows.append({
            "window": len(self.windows), "end_tokens": now["tokens"],
            "tau": diff["tokens"] / diff["row_steps"],
            "us_per_row": diff["propose_s"] * 1e6 / max(diff["propose_rows"], 1),
            **delta, "nodes": d.num_nodes(), "peak_nodes": self.window_peak,
            "array_bytes": d.forest.nbytes, "rss_mb": rss_mb(),
            "elapsed_s": time.perf_counter() - self.t0, "partial": partial,
        })
        self.start, self._last_counters, self.window_peak = now, counters, d.num_nodes()


def check(windows: list[dict]) -> list[str]:
    """Windows holding an eviction, and the one after each, against the window
    before (a short last window is too noisy to judge)."""
    failures = []
    for w in windows[1:]:
        if not w["evictions"]:
            continue
        before = windows[w["window"] - 1]["tau"]
        for v in windows[w["window"]:w["window"] + 2]:
            if not v["partial"] and v["tau"] < (1 - MAX_DROP) * before:
                failures.append(f"window {v['window']}: tau {v['tau']:.3f} < {1 - MAX_DROP:.2f} x "
                                f"{before:.3f} (window {w['window'] - 1}, before the eviction in "
                                f"window {w['window']})")
    return sorted(set(failures))


def call_percentiles(calls: list[tuple[float, float]]) -> dict:
    """p50 / p99 / p99.9 / max of propose() calls, wall and thread CPU, in ms."""
    out = {"propose_calls": len(calls)}
    for j, name in enumerate(("wall", "cpu")):
        a = np.array([c[j] for c in calls]) * 1e3 if calls else np.zeros(1)
        for q, label in ((50, "p50"), (99, "p99"), (99.9, "p999")):
            out[f"propose_{name}_ms_{label}"] = float(np.percentile(a, q))
        out[f"propose_{name}_ms_max"] = float(a.max())
        out[f"propose_{name}_max_call"] = int(a.argmax()) + 1  # 1-based: which call it was
        out[f"propose_{name}_ms_max_after_first"] = float(a[1:].max()) if len(a) > 1 else 0.0
        out[f"propose_{name}_over_10ms"] = int((a > 10).sum())
    return out


def pass_problems(problems: list[Problem], p: int, seed: int) -> list[Problem]:
    order = list(range(len(problems)))
    random.Random(seed * 1000 + p).shuffle(order)
    return [Problem(f"{p}:{problems[i].id}", [PASS_TOKEN + p] + problems[i].prompt,
                    problems[i].completions) for i in order]


def produced(problem: Problem) -> int:
    return sum(len(c) - 1 for c in problem.completions)  # the first token comes from prefill


def run(args) -> dict:
    tokenizer = load_tokenizer(args.tokenizer)
    problems: list[Problem] = []
    for _, path in trace_sets(args.traces, DEFAULT_TRACES):
        problems += load_problems(path, tokenizer)
    per_pass = sum(map(produced, problems))
    options = {"max_trie_nodes": args.max_trie_nodes}
    # + 1: each pass puts its own token before every prompt
    drafter = make_drafter("consensus", args.k, max_len(problems, args.k + 1), args.rows, options)
    proposer = drafter.proposer  # the ConsensusProposer it calls
    rss0 = rss_mb()
    monitor = Monitor(proposer, args.window)
    left, p = args.tokens, 0
    print(f"{len(problems)} problems, {per_pass:,} tokens a pass; streaming {args.tokens:,} tokens "
          f"at {args.rows} rows, k={args.k}, max_trie_nodes={args.max_trie_nodes:,}", file=sys.stderr)
    while left > 0:
        batch = pass_problems(problems, p, args.seed)
        gc.freeze()  # as vLLM's engine core does after start-up: the harness's traces
        #              (millions of Python ints) must not make GC pauses inside propose()
        if per_pass > left:  # the last pass: just enough problems
            ends = list(itertools.accumulate(produced(x) for x in batch))  # tokens after each problem
            batch = batch[:bisect.bisect_left(ends, left) + 1]
        stats = replay(batch, drafter, "consensus", args.k, args.rows, on_step=monitor)
        monitor.end_pass(stats)
        left -= stats.tokens
        p += 1
        print(f"pass {p}: {stats.tokens:,} tokens, tau {stats.tau:.3f}, "
              f"{time.perf_counter() - monitor.t0:.0f} s", file=sys.stderr)
    monitor.close(dict(monitor.base))  # the last, partial window
    failures = check(monitor.windows)
    failed_steps = proposer.num_failures
    summary = {
        "tokens": monitor.base["tokens"], "passes": p,
        "tau": monitor.base["tokens"] / max(monitor.base["row_steps"], 1),
        "max_trie_nodes": args.max_trie_nodes, "peak_nodes": monitor.peak_nodes,
        "peak_nodes_over_limit": monitor.peak_nodes / args.max_trie_nodes,
        "peak_node_capacity": monitor.peak_capacity,
        "peak_array_bytes": monitor.peak_bytes,
        "node_budget_bytes": proposer.drafter.forest.arena()[0].nbytes,  # the node array, no edge tables
        "arena_reallocations": monitor.arena_changes,
        **call_percentiles(monitor.calls),
        "rss_start_mb": rss0, "rss_end_mb": rss_mb(),
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **monitor.counters(),  # evictions, groups (live ones) and nodes evicted
        **eviction_times(proposer.drafter),
        "failed_steps": failed_steps, "check_failures": failures,
        "check_passed": not failures and not failed_steps,
    }
    return {"args": vars(args), "summary": summary, "windows": monitor.windows}


def markdown(result: dict) -> str:
    s = result["summary"]
    mb = 1 << 20
    lines = ["| window | tokens (M) | tau | drafter µs/row-step | evictions | groups evicted (live) "
             "| nodes evicted | nodes at end | peak nodes | arrays MB | RSS MB |", "|" + "---|" * 11]
    for w in result["windows"]:
        lines.append(
            f"| {w['window']}{' (partial)' if w['partial'] else ''} | {w['end_tokens'] / 1e6:.2f} | "
            f"{w['tau']:.3f} | {w['us_per_row']:.1f} | "
            f"{w['evictions']} | {w['groups_evicted']} ({w['live_groups_evicted']}) | "
            f"{w['nodes_evicted']:,} | {w['nodes']:,} | {w['peak_nodes']:,} | "
            f"{w['array_bytes'] / mb:.0f} | {w['rss_mb']:.0f} |")
    lines += [
        "",
        f"- {s['tokens']:,} tokens in {s['passes']} passes, tau {s['tau']:.3f}",
        f"- evictions: {s['evictions']} (wall mean {s['eviction_ms_mean']:.0f} ms, max "
        f"{s['eviction_ms_max']:.0f} ms; CPU mean {s['eviction_cpu_ms_mean']:.0f} ms), "
        f"{s['groups_evicted']:,} group tries dropped "
        f"({s['live_groups_evicted']:,} with live paths), {s['nodes_evicted']:,} nodes",
        f"- peak nodes {s['peak_nodes']:,} = {s['peak_nodes_over_limit']:.3f} x max_trie_nodes "
        f"({s['max_trie_nodes']:,}); node array capacity peak {s['peak_node_capacity']:,} rows",
        f"- arrays (nodes + table) peak {s['peak_array_bytes'] / mb:.0f} MB vs "
        f"{s['node_budget_bytes'] / mb:.0f} MB for max_trie_nodes node rows "
        f"({s['peak_array_bytes'] / s['node_budget_bytes']:.2f} x, "
        f"{s['peak_array_bytes'] / s['max_trie_nodes']:.0f} B per max_trie_nodes node)",
        f"- propose() per call, {s['propose_calls']:,} calls: wall p50 "
        f"{s['propose_wall_ms_p50']:.2f} ms, p99 {s['propose_wall_ms_p99']:.2f}, p99.9 "
        f"{s['propose_wall_ms_p999']:.2f}, max {s['propose_wall_ms_max']:.2f} (call "
        f"{s['propose_wall_max_call']}; after the first {s['propose_wall_ms_max_after_first']:.2f}) "
        f"({s['propose_wall_over_10ms']} calls over 10 ms); thread CPU p50 "
        f"{s['propose_cpu_ms_p50']:.2f}, p99.9 {s['propose_cpu_ms_p999']:.2f}, max "
        f"{s['propose_cpu_ms_max']:.2f} ({s['propose_cpu_over_10ms']} over 10 ms); "
        f"arrays reallocated {s['arena_reallocations']} times",
        f"- RSS {s['rss_start_mb']:.0f} MB before streaming, {s['rss_end_mb']:.0f} MB at the end, "
        f"peak {s['max_rss_mb']:.0f} MB",
        f"- check (tau within {MAX_DROP:.0%} after each eviction, no failed drafting steps): "
        + ("passed" if s["check_passed"] else "FAILED")
        + "".join(f"\n  - {f}" for f in s["check_failures"])
        + (f"\n  - {s['failed_steps']} drafting steps failed" if s["failed_steps"] else ""),
    ]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m evals stream", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=20_000_000, help="tokens to generate in all")
    ap.add_argument("--max-trie-nodes", type=int, default=DrafterOptions().max_trie_nodes)
    ap.add_argument("--window", type=int, default=1_000_000, help="tokens per reported window")
    ap.add_argument("--rows", type=int, default=128, help="batch rows")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--traces", nargs="+", help="trace files (default: the shared traces)")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: shared GPT-2)")
    ap.add_argument("--seed", type=int, default=0, help="shuffle seed")
    ap.add_argument("--out", help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    if min(args.tokens, args.window, args.rows, args.k) < 1:
        ap.error("--tokens, --window, --rows and --k must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except (TraceError, ValueError) as e:
        return fail(e)
    print(markdown(result))
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return 0 if result["summary"]["check_passed"] else 1
