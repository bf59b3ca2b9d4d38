"""The device route's four GPU checks, PyTorch only (docs/async.md, "GPU
checks", says what each measures and why).

    python -m evals gpu-check [--out DIR] [--toy] [--device cuda]

``--checks``: ``gather`` (the table gather of
:class:`consensus_spec.device_route.table.ContextTable`, eager and from a CUDA
graph), ``overlap`` (pinned -> device copies beside Qwen2.5-7B-shaped GEMMs),
``lag`` (device -> host copies under async scheduling), ``step_costs`` (the
GEMM stack against the H200 table's ``gemm_ms``).

Writes ``gpu_check.jsonl`` in ``--out`` (default ``$OUT`` or ``results/``),
one record per measurement, and prints a summary. About 5 minutes on one
H200. ``--toy``: tiny sizes that run on a CPU in seconds (CI keeps the
script from rotting; the numbers mean nothing there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from ..options import fail

# Qwen2.5-7B (hidden, q/k/v out, intermediate, layers) and the H200 table's
# gemm_ms at (B, q) (../shared/data/costs/h200_qwen2.5-7b_step_ms.jsonl)
SHAPE_7B = (3584, 4608, 18944, 28)
SHAPE_TOY = (64, 96, 128, 2)
TABLE_GEMM_MS = {(64, 1): 4.523, (64, 2): 4.8096, (64, 3): 7.9145, (64, 5): 7.7918,
                 (128, 1): 4.813, (128, 2): 6.2994, (128, 3): 9.3552, (128, 5): 13.3933}


class Gemms:
    """The decode step's weight GEMMs (no attention), ``tokens`` rows in."""

    def __init__(self, torch, device, shape, dtype):
        h, qkv, inter, layers = shape
        self.torch = torch
        make = lambda a, b: torch.randn(a, b, device=device, dtype=dtype) * 0.01  # noqa: E731
        self.layers = [(make(h, qkv), make(h, h), make(h, 2 * inter), make(inter, h)) for _ in range(layers)]
        self.h, self.device, self.dtype = h, device, dtype

    def step(self, x):
        for w_qkv, w_o, w_gu, w_down in self.layers:
            x.matmul(w_qkv)
            x = x.matmul(w_o)
            g = x.matmul(w_gu)
            x = g[:, :w_down.shape[0]].matmul(w_down)
        return x

    def input(self, tokens):
        return self.torch.randn(tokens, self.h, device=self.device, dtype=self.dtype)


def _sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(torch, device, fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        _sync(torch, device)
        t0 = time.perf_counter()
        fn()
        _sync(torch, device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def check_gather(torch, device, gemms, toy: bool, emit) -> None:  # no GEMMs: the table alone
    from consensus_spec.device_route.table import ContextTable

    sizes = (2_000, 10_000) if toy else (100_000, 600_000, 4_000_000)
    rows = (4, 16) if toy else (16, 64, 128)
    reps = 20 if toy else 1000
    gen = torch.Generator(device="cpu").manual_seed(0)
    for n in sizes:
        table = ContextTable(n, 8, 1, 0.5, 0.8, device)
        keys = torch.randint(-(1 << 62), 1 << 62, (n,), generator=gen).to(device)
        nodes = torch.arange(n, device=device)
        table.apply([], [], keys, nodes, torch.zeros_like(nodes), nodes,
                    torch.randint(0, 50, (n, 3), generator=gen, dtype=torch.int32).to(device))
        for b in rows:
            text = torch.randint(0, 50, (b, 8), generator=gen).to(device)
            avail = torch.full((b,), 8, device=device)
            groups = torch.randint(0, n, (b,), generator=gen).to(device)
            for k in (1, 4, 8):
                eager = _time_ms(torch, device, lambda: table.draft(text, avail, groups, 7, k),
                                 max(reps // 5, 5))
                rec = {"check": "gather", "entries": n, "rows": b, "k": k,
                       "eager_ms_median": statistics.median(eager)}
                if device.type == "cuda":
                    stream = torch.cuda.Stream(device)
                    stream.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(stream):
                        for _ in range(3):
                            table.draft(text, avail, groups, 7, k)
                    torch.cuda.current_stream(device).wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        table.draft(text, avail, groups, 7, k)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    times = []
                    for _ in range(reps):
                        start.record()
                        graph.replay()
                        end.record()
                        end.synchronize()
                        times.append(start.elapsed_time(end))
                    rec["graph_ms_median"] = statistics.median(times)
                    rec["graph_ms_p90"] = sorted(times)[int(0.9 * len(times))]
                emit(rec)


def check_overlap(torch, device, gemms, toy: bool, emit) -> None:
    cuda = device.type == "cuda"
    steps = 5 if toy else 200
    sizes = (25_000, 1_000_000, 3_000_000, 6_600_000)
    for b, q in ((16, 7), (128, 2)):
        x = gemms.input(b * q)
        base = _time_ms(torch, device, lambda: [gemms.step(x) for _ in range(steps)], 3)
        for size in sizes:
            host = torch.empty(size // 4, dtype=torch.int32, pin_memory=cuda)
            dev = torch.empty(size // 4, dtype=torch.int32, device=device)
            stream = torch.cuda.Stream(device) if cuda else None
            latencies = []

            def loop():
                for _ in range(steps):
                    gemms.step(x)
                    if cuda:
                        with torch.cuda.stream(stream):
                            a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            a.record()
                            dev.copy_(host, non_blocking=True)
                            z.record()
                        latencies.append((a, z))
                    else:
                        dev.copy_(host)
            with_copies = _time_ms(torch, device, loop, 3)
            lat = [a.elapsed_time(z) for a, z in latencies] if cuda else []
            emit({"check": "overlap", "rows": b, "q": q, "copy_bytes": size, "steps": steps,
                  "loop_ms_no_copies": min(base), "loop_ms_with_copies": min(with_copies),
                  "slowdown_pct": 100.0 * (min(with_copies) / min(base) - 1.0),
                  "copy_ms_median": statistics.median(lat) if lat else None})


def _busy_python(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:  # holds the GIL, as the numba-free Python of a feed does
        x += 1


def check_lag(torch, device, gemms, toy: bool, emit) -> None:
    cuda = device.type == "cuda"
    steps = 8 if toy else 400
    x = gemms.input(128 * 2)
    tokens = torch.zeros((128, 9), dtype=torch.int32, device=device)
    for host_work_ms in (0.0, 0.3):
        stream = torch.cuda.Stream(device) if cuda else None
        pending, lags, done_steps = [], [], []
        for t in range(steps):
            gemms.step(x)
            tokens.add_(1)  # "sampling" writes the step's tokens
            step_done = torch.cuda.Event() if cuda else None
            if cuda:
                step_done.record()
                host = torch.empty((128, 9), dtype=torch.int32, pin_memory=True)
                with torch.cuda.stream(stream):
                    stream.wait_stream(torch.cuda.current_stream(device))
                    host.copy_(tokens, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record()
                pending.append((t, ev))
            else:
                host = tokens.clone()
                pending.append((t, None))
            done_steps.append(step_done)
            if t >= 1 and cuda:  # async scheduling: at most one step in flight ahead of the host
                done_steps[t - 1].synchronize()
            if host_work_ms:
                _busy_python(host_work_ms / 1e3)
            still = []
            for s, ev in pending:  # the next propose call polls, never waits
                if ev is None or ev.query():
                    lags.append(t + 1 - s)
                else:
                    still.append((s, ev))
            pending = still
        _sync(torch, device)
        counts = {lag: lags.count(lag) for lag in sorted(set(lags))}
        emit({"check": "lag", "host_work_ms": host_work_ms, "steps": steps, "copies_seen": len(lags),
              "lag_counts": counts, "share_lag_1": counts.get(1, 0) / max(len(lags), 1)})


def check_step_costs(torch, device, gemms, toy: bool, emit) -> None:
    reps = 3 if toy else 30
    for (b, q), table_ms in TABLE_GEMM_MS.items():
        x = gemms.input(b * q)
        gemms.step(x)
        times = _time_ms(torch, device, lambda: gemms.step(x), reps)
        emit({"check": "step_costs", "rows": b, "q": q, "gemm_ms_median": statistics.median(times),
              "table_gemm_ms": table_ms})


CHECKS = {"gather": check_gather, "overlap": check_overlap, "lag": check_lag, "step_costs": check_step_costs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "results")
    ap.add_argument("--toy", action="store_true",
                    help="tiny sizes (CPU, CI): the script runs, nothing is measured")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--checks", nargs="+", default=list(CHECKS), choices=list(CHECKS))
    args = ap.parse_args(argv)
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.toy:
        return fail("no CUDA device; full sizes need a GPU (use --toy on a CPU)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_check.jsonl")
    meta = {"check": "meta", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "toy": args.toy}
    t_start = time.perf_counter()
    with open(path, "w", encoding="utf-8") as f:
        def emit(rec):
            rec["t_s"] = round(time.perf_counter() - t_start, 2)
            f.write(json.dumps(rec) + "\n")
            f.flush()
            print(json.dumps(rec), flush=True)
        emit(meta)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        gemms = None
        if set(args.checks) - {"gather"}:
            gemms = Gemms(torch, device, SHAPE_TOY if args.toy else SHAPE_7B, dtype)
        with torch.inference_mode():
            for name in args.checks:
                t0 = time.perf_counter()
                CHECKS[name](torch, device, gemms, args.toy, emit)
                emit({"check": "done", "name": name, "seconds": round(time.perf_counter() - t0, 1)})
    print(f"wrote {path}")
    return 0
