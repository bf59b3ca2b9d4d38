"""What machine a timing came from, in figures another machine can be
compared by: the time of a fixed pure-Python loop (every host-side figure
here scales with it, so figures taken on different machines, or on one
machine under different load, can be compared) and the instruction set
numba compiled for (``--isa``: :mod:`.isa`)."""

from __future__ import annotations

import os
import statistics
import time

LOOP = 200_000


def python_loop_ns(repeats: int = 5) -> float:
    """Median CPU nanoseconds per iteration of a fixed pure-Python loop."""
    times = []
    for _ in range(repeats):
        t0 = time.process_time_ns()
        x = 0
        for i in range(LOOP):
            x += i & 7
        times.append((time.process_time_ns() - t0) / LOOP)
    return statistics.median(times)


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
    return (f"Machine: {describe()}; the Python loop (evals/machine.py) took {span} "
            "ns an iteration (CPU time, median of 5" + (", before / after" if after is not None else "")
            + ").")
