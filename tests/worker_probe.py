"""A vLLM worker extension the soaks read the engine worker through.

Mixed into vLLM's worker by ``--worker-extension-cls tests.worker_probe.ProposerCounters``
and called through the dev-mode route ``POST /collective_rpc`` (the server
started with ``VLLM_SERVER_DEV_MODE=1``).  It works on a server without
speculation too (the plain control): then only the memory fields are filled.

- ``consensus_spec_counters(trim="")``: the proposer's counters and bounds,
  the MB its arrays hold, the worker's RSS, Python's allocated blocks, the C
  allocator's own account (``mallinfo2``: heap in use and free, mmapped),
  numba's allocations not freed since the first call, and the address ranges of the trie arena and of
  vLLM's KV cache (for attributing the worker's mappings, see
  :mod:`tests.process_memory`) with the MB of each resident, page by page
  (:func:`resident_bytes`: exact where a mapping merged with a neighbour is not).  ``trim="1"``: first hand freed heap back to the
  OS (glibc ``malloc_trim``), reporting the RSS before: what of the growth is
  live memory and what is heap the allocator kept.
- ``consensus_spec_tracemalloc(action)``: ``"start"`` traces allocations
  (Python objects and numpy buffers) from now on; ``"diff"`` reports the
  traced MB and the allocation sites that grew most since ``"start"``.

Imported inside the engine process: the top level uses only the standard library.
"""

from __future__ import annotations

import array
import ctypes
import mmap
import sys

_BASELINE: list = []  # the tracemalloc snapshot taken at "start"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


def malloc_info() -> dict | None:
    """glibc's account of this process's heap, in MB: ``heap`` (obtained with
    brk/arenas), ``in_use`` and ``free`` of it, ``mmapped`` (big blocks),
    ``free_chunks``; None where mallinfo2 is missing (not glibc, or < 2.33)."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    m = fn()
    mb = lambda v: round(v / 2**20, 1)  # noqa: E731
    return {"heap": mb(m.arena), "in_use": mb(m.uordblks), "free": mb(m.fordblks),
            "mmapped": mb(m.hblkhd), "free_chunks": m.ordblks}


def resident_bytes(ranges: list) -> int:
    """Bytes of this process's pages present in memory within ``ranges``
    (``[[start, bytes], ...]``), read page by page from ``/proc/self/pagemap``
    (bit 63 of a page's entry: present; a huge page's 4 KB parts each count)."""
    page, total = mmap.PAGESIZE, 0
    with open("/proc/self/pagemap", "rb") as f:
        for start, size in ranges:
            first, last = start // page, (start + size - 1) // page
            f.seek(8 * first)
            entries = array.array("Q", f.read(8 * (last - first + 1)))
            total += sum(e >> 63 for e in entries) * page
    return total


def self_rss_mb() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) // 1024
    except (OSError, StopIteration, ValueError):
        return None


def _regions(runner, drafter) -> dict:
    """name -> [[start address, bytes], ...] of the big buffers whose pages
    the worker's RSS holds: the trie arena (nodes, edge tables) and the KV cache."""
    out: dict[str, list] = {}
    forest = getattr(getattr(drafter, "drafter", None), "forest", None)
    if forest is not None:
        arrays = [forest._nodes, *forest._tables, forest._spare]
        out["trie_arena"] = [[a.ctypes.data, a.nbytes] for a in arrays]
    caches = getattr(runner, "kv_caches", None) or []
    spans = {}
    for t in caches:
        try:
            storage = t.untyped_storage()
            spans[storage.data_ptr()] = storage.nbytes()
        except Exception:  # noqa: BLE001 - a layout this probe does not know: left out
            continue
    if spans:
        out["kv_cache"] = [[p, n] for p, n in sorted(spans.items())]
    return out


def _numba_net() -> int | None:
    """numba's runtime allocations less its frees since the first probe
    (its counting starts then): kernels' arrays not handed back."""
    runtime = sys.modules.get("numba.core.runtime")
    if runtime is None:
        return None
    try:
        from numba.core.runtime import _nrt_python
        if not _nrt_python.memsys_stats_enabled():
            _nrt_python.memsys_enable_stats()
        stats = runtime.rtsys.get_allocation_stats()
    except Exception:  # noqa: BLE001 - another numba: left out
        return None
    return int(stats.alloc - stats.free)


class ProposerCounters:
    """See the module docstring."""

    def consensus_spec_counters(self, trim: str = ""):
        runner = getattr(self, "model_runner", None)
        drafter = getattr(runner, "drafter", None)
        counters = getattr(drafter, "counters", None)
        out = {"proposer": type(drafter).__name__ if drafter is not None else None}
        if trim:
            out["worker_rss_before_trim_mb"] = self_rss_mb()
            ctypes.CDLL(None).malloc_trim(0)
        if counters is not None:
            out.update(counters())
            # MB held in the drafting state's arrays (trie arena, hash table, row tracking)
            parts = {"drafter": getattr(drafter, "drafter", None), "rows": getattr(drafter, "rows", None)}
            parts["forest"] = getattr(parts["drafter"], "forest", None)
            out["arrays_mb"] = {name: round(sum(v.nbytes for v in vars(obj).values()
                                                if type(v).__name__ == "ndarray") / 2**20, 1)
                                for name, obj in parts.items() if obj is not None}
        out["regions"] = _regions(runner, drafter)
        try:
            out["regions_resident_mb"] = {name: round(resident_bytes(ranges) / 2**20, 1)
                                          for name, ranges in out["regions"].items()}
        except (OSError, ValueError):  # no pagemap here: the mapping-level reading only
            pass
        out["malloc"] = malloc_info()
        out["numba_net_allocations"] = _numba_net()
        out["worker_rss_mb"] = self_rss_mb()
        out["python_blocks"] = sys.getallocatedblocks()  # pymalloc blocks: Python objects
        return out

    def consensus_spec_tracemalloc(self, action: str = "diff", top: int = 12):
        import tracemalloc

        def snapshot():  # tracemalloc's own and linecache's (reading tracebacks) left out
            return tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__),
                 tracemalloc.Filter(False, "<unknown>"), tracemalloc.Filter(False, "*/linecache.py")])

        if action == "start":
            if not tracemalloc.is_tracing():
                tracemalloc.start(6)
            _BASELINE[:] = [snapshot()]
            return {"tracing": True}
        if not _BASELINE:
            return {"tracing": False}
        snap = snapshot()
        stats = snap.compare_to(_BASELINE[0], "traceback")
        return {"tracing": True,
                "traced_mb": round(sum(s.size for s in snap.statistics("filename")) / 2**20, 2),
                "grew_mb": round(sum(s.size_diff for s in stats) / 2**20, 2),
                "top": [{"mb": round(s.size_diff / 2**20, 3), "blocks": s.count_diff,
                         "where": s.traceback.format()[-4:]} for s in stats[:top]]}


EXTENSION = "tests.worker_probe.ProposerCounters"
