"""Allocation tracing in a soaked vLLM API server (``python -m tests.memory_soak --tracemalloc``).

Put on the server's ``PYTHONPATH`` with ``CONSENSUS_SPEC_SOAK_TRACE_DIR``
set, Python imports this at start-up in every process; only the API server
(its command line names ``vllm.entrypoints.openai.api_server``, its
children do not) starts a thread that answers requests the soak drops in
that folder.  The first ``request-N`` starts ``tracemalloc`` (the soak's
first is at warm-up: tracing from the start slows vLLM's imports for
minutes); each later one makes it write ``result-N.json``: the MB traced,
i.e. allocated since then and still held, the allocation sites holding
most, and what is left after a full garbage collection (so what was held
only by reference cycles; the collection changes what follows: this is a
diagnostic).  The engine worker is traced through the worker probe instead
(``tests/worker_probe.py``).
"""

import os
import sys

_DIR = os.environ.get("CONSENSUS_SPEC_SOAK_TRACE_DIR")


def _serve(folder: str) -> None:
    import gc
    import json
    import time
    import tracemalloc

    def snapshot():  # tracemalloc's own and linecache's (reading tracebacks) left out
        return tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<unknown>"),
             tracemalloc.Filter(False, "*/linecache.py")])

    baseline = None
    while True:
        time.sleep(0.5)
        for name in sorted(os.listdir(folder)):
            if not name.startswith("request-"):
                continue
            n = name.split("-", 1)[1]
            if not tracemalloc.is_tracing():
                tracemalloc.start(8)
            snap = snapshot()
            if baseline is None:
                baseline = snap
            stats = snap.compare_to(baseline, "traceback")
            unreachable = gc.collect()  # what of it was garbage in cycles, awaiting a full collection
            after = snapshot()
            out = {"pid": os.getpid(),
                   "traced_mb": round(sum(s.size for s in snap.statistics("filename")) / 2**20, 2),
                   "grew_mb": round(sum(s.size_diff for s in stats) / 2**20, 2),
                   "unreachable_collected": unreachable,
                   "traced_after_gc_mb": round(
                       sum(s.size for s in after.statistics("filename")) / 2**20, 2),
                   "gc_counts": gc.get_count(), "gc_stats": gc.get_stats(),
                   "top": [{"mb": round(s.size_diff / 2**20, 3), "blocks": s.count_diff,
                            "where": s.traceback.format()[-6:]} for s in stats[:12]]}
            tmp = os.path.join(folder, f".result-{n}")
            with open(tmp, "w") as f:
                json.dump(out, f)
            os.replace(tmp, os.path.join(folder, f"result-{n}.json"))
            os.remove(os.path.join(folder, name))


if _DIR and "vllm.entrypoints.openai.api_server" in getattr(sys, "orig_argv", []):
    import threading
    import tracemalloc

    os.register_at_fork(after_in_child=tracemalloc.stop)  # engine processes forked off: untraced
    threading.Thread(target=_serve, args=(_DIR,), name="soak-tracemalloc", daemon=True).start()
