"""What machine a timing came from, in figures another machine can be
compared by: the time of a fixed pure-Python loop (every host-side figure
here scales with it) and the instruction set numba compiled for."""

from __future__ import annotations

import os
import statistics
import time

LOOP_N = 1_000_000


def python_loop_ns(repeats: int = 5, n: int = LOOP_N) -> float:
    """CPU ns per iteration of a fixed pure-Python loop (``total += i``),
    the median of ``repeats`` runs: how fast this machine runs Python now
    (about 25 on this project's shared 2-core AMD EPYC)."""
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        total = 0
        for i in range(n):
            total += i
        times.append(time.process_time() - t0)
    return statistics.median(times) * 1e9 / n


def describe() -> str:
    """One line: the CPU model, and the target numba compiles for."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                         model)
    except OSError:
        pass
    target = os.environ.get("NUMBA_CPU_NAME") or "host"
    return f"{model}, {os.cpu_count()} cores, numba target {target}"


def loop_line(before: float, after: float | None = None) -> str:
    """The figures' Python-loop time as a sentence for a report."""
    span = f"{before:.1f}" + (f" / {after:.1f}" if after is not None else "")
    return (f"Machine: {describe()}; a fixed pure-Python loop took {span} ns an iteration "
            "(CPU time, median of 5" + (", before / after" if after is not None else "") + ").")
