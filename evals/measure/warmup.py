"""First-request latency of the proposer with and without warm-up at construction.

    python -m evals warmup [--rows 64] [--repeats 3]
    python -m evals warmup --compile-only    # fill numba's cache (.ci/setup runs it)

Each case runs in a fresh process (so nothing is compiled or imported yet),
with numba's on-disk cache either empty ("cold": a new install) or filled
by an earlier run ("warm": a restarted server). Reported per case: the
constructor's time, the slowest of the first ``propose()`` calls (what
the first request waits for), and a later call's time for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def _one(rows: int, warmup: bool) -> dict:
    from consensus_spec import ConsensusProposer
    from evals.replay.drafters import stand_in_config

    t0 = time.perf_counter()
    p = ConsensusProposer(stand_in_config(8, 512, rows), warmup=warmup)
    built = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    tokens = np.zeros((rows, 512), np.int32)
    lengths = np.full(rows, 40, np.int32)
    tokens[:, :40] = rng.integers(0, 1000, 40)  # one prompt: all rows are siblings
    times = []
    for _ in range(5):
        new = rng.integers(0, 50, rows)
        tokens[np.arange(rows), lengths] = new
        lengths += 1
        t = time.perf_counter()
        p.propose([[int(x)] for x in new], lengths, tokens)
        times.append(time.perf_counter() - t)
    # the slowest of the first calls: the step-cost fit first runs on the second
    return {"construct_s": built, "first_propose_s": max(times[:-1]), "later_propose_s": times[-1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals warmup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    ap.add_argument("--compile-only", action="store_true",
                    help="compile the kernels into numba's cache and exit (setup runs this)")
    args = ap.parse_args(argv)
    if args.compile_only:
        r = _one(2, True)
        print(f"consensus_spec kernels compiled and cached ({r['construct_s']:.1f} s)")
        return 0
    if args.child:
        print(json.dumps(_one(args.rows, args.child == "on")))
        return 0
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo
    print("| numba cache | warm-up | construct s | first propose s | later propose s |\n|---|---|---|---|---|")
    for rep in range(args.repeats):
        for warm in ("on", "off"):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "NUMBA_CACHE_DIR": cache}
                for state in ("cold", "warm"):  # the second run finds the first run's cache
                    out = subprocess.run([sys.executable, "-m", "evals", "warmup", "--child", warm,
                                          "--rows", str(args.rows)], cwd=root, env=env,
                                         capture_output=True, text=True, check=True)
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    print(f"| {state} | {warm} | {r['construct_s']:.3f} | {r['first_propose_s']:.3f} | "
                          f"{r['later_propose_s'] * 1e3:.2f} ms |", flush=True)
    return 0
