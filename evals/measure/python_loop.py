"""The machine's Python-loop time: a yardstick printed beside host-time
figures, so figures taken on different machines (or on one machine under
different load) can be compared."""

from __future__ import annotations

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
