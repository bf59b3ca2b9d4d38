"""Whose memory a server holds, read from /proc: the resident memory of
each process of its tree (named as vLLM titles them), and one process's
mappings attributed to what holds them.

:func:`attribute` sorts a process's mappings (``/proc/PID/smaps``) into
the named address ranges given (the trie arena, vLLM's KV cache: the
worker probe reports where they are) and otherwise by kind: ``heap`` (the
C allocator's main heap), ``anonymous`` (other anonymous memory: big
allocations, thread heaps, numpy and torch buffers), ``files`` (libraries
and mapped files) and ``other`` (stacks, vdso).  :func:`grown` lists the
mappings whose resident memory changed most between two readings.
:func:`resident_bytes` counts this process's pages present in given
address ranges, page by page (``/proc/self/pagemap``): exact where a
mapping-level reading is not (Linux may merge a mapping with a neighbour).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.server_soak import process_label, process_tree, rss_kb
from tests.worker_probe import resident_bytes  # noqa: F401  (one definition; the worker's probe reads it too)

_HEAD = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")


def mappings(pid: int) -> list[dict]:
    """Each mapping of ``pid``: start, end, path, rss_kb (empty if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return []
    out: list[dict] = []
    for line in text.splitlines():
        m = _HEAD.match(line)
        if m:
            out.append({"start": int(m.group(1), 16), "end": int(m.group(2), 16),
                        "path": m.group(4).strip(), "rss_kb": 0})
        elif out and line.startswith("Rss:"):
            out[-1]["rss_kb"] = int(line.split()[1])
    return out


def _kind(path: str) -> str:
    if path == "[heap]":
        return "heap"
    if not path or path.startswith("[anon") or path.startswith("/dev/zero"):
        return "anonymous"
    if path.startswith("/"):
        return "files"
    return "other"


def attribute(maps: list[dict], regions: dict[str, list] | None = None) -> dict[str, float]:
    """MB resident per owner: a named region (``[[start, bytes], ...]``)
    takes every mapping that lies mostly inside its ranges, together (Linux
    merges adjacent mappings alike: the arena's edge tables come as one)."""
    spans = {name: [(start, start + size) for start, size in ranges]
             for name, ranges in (regions or {}).items()}
    out: dict[str, float] = {}
    for m in maps:
        size = m["end"] - m["start"]
        owner = next((name for name, ranges in spans.items()
                      if sum(max(min(hi, m["end"]) - max(lo, m["start"]), 0)
                             for lo, hi in ranges) > size / 2), None)
        key = owner or _kind(m["path"])
        out[key] = out.get(key, 0.0) + m["rss_kb"] / 1024.0
    return {k: round(v, 1) for k, v in sorted(out.items())}


def grown(before: list[dict], after: list[dict], top: int = 8, min_mb: float = 1.0) -> list[dict]:
    """The mappings whose resident MB changed most from ``before`` to ``after``
    (keyed by start address and path; a mapping that came or went counts whole)."""
    old = {(m["start"], m["path"]): m for m in before}
    new = {(m["start"], m["path"]): m for m in after}
    rows = []
    for key in old.keys() | new.keys():
        a, b = old.get(key), new.get(key)
        delta = ((b["rss_kb"] if b else 0) - (a["rss_kb"] if a else 0)) / 1024.0
        if abs(delta) >= min_mb:
            m = b or a
            rows.append({"mb": round(delta, 1), "rss_mb": round((b["rss_kb"] if b else 0) / 1024, 1),
                         "size_mb": round((m["end"] - m["start"]) / 2**20, 1),
                         "start": hex(m["start"]), "path": m["path"] or "[anonymous]"})
    rows.sort(key=lambda r: -abs(r["mb"]))
    return rows[:top]


def tree(pid: int) -> dict[str, float]:
    """MB resident per process of ``pid``'s tree, by title (``VLLM::Worker``,
    ``APIServer``, ``math-verify helper``...; processes of one title summed)."""
    out: dict[str, float] = {}
    for p in process_tree(pid):
        name = process_label(p).rsplit(":", 1)[0]
        out[name] = round(out.get(name, 0.0) + rss_kb(p) / 1024.0, 1)
    return out


def find(pid: int, title: str) -> int | None:
    """The process of ``pid``'s tree whose label starts with ``title``."""
    for p in process_tree(pid):
        if process_label(p).startswith(title):
            return p
    return None
