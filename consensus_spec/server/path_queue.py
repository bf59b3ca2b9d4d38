"""The endpoint's own queue in front of the engine: its paths enter the
engine's batch oldest problem first.

vLLM's queue is first come, first served.  A problem that waves sends its
later waves while newer problems' first waves are already queued, so the
vote an old problem waits on queues behind problems that arrived after it,
and that wait is the endpoint's tail (at 32 clients, waves of 4 filled the
batch with first waves and the p95 grew).  An ``n``-path request never
meets this: its paths all queue at once, in arrival order.

So the endpoint holds its paths here while the batch is full and hands each
row that frees to the oldest waiting problem's next path: the order an
``n``-path client's requests get, with a settled vote's unsent paths never
sent at all.  A few paths more than the batch holds (``slack``) wait in the
engine's own queue, so a row that frees is filled at the engine's next step
rather than a round trip later.  While the batch has room nothing waits
here: on an idle server a path goes straight to the engine.

Pure asyncio, no vLLM: ``stream`` wraps any ``generate`` stream.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Any, AsyncIterator, Callable, Iterable

__all__ = ["PathQueue", "QUEUES"]

QUEUES = ("oldest", "engine")  # CONSENSUS_SPEC_SC_QUEUE, the default first


class PathQueue:
    """Paths in the engine, counted, and paths waiting for a row, oldest
    first.  ``rows()``: the rows this endpoint's paths may hold now (the
    batch less other requests' rows, plus the slack)."""

    def __init__(self, rows: Callable[[], int]):
        self._rows = rows
        self.in_engine = 0  # paths handed to the engine and not yet ended
        self._heap: list = []  # (order, seq, request id); stale entries skipped
        self._waiting: dict[str, asyncio.Future] = {}
        self._seq = itertools.count()
        self.held_total = 0  # paths that waited here (the state route shows it)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def _enter(self, rid: str, order: tuple) -> bool:
        """True once ``rid`` may enter the engine (counted in), False if it
        was dropped (:meth:`drop`) while it waited."""
        if not self._waiting and self.in_engine < self._rows():
            self.in_engine += 1
            return True
        fut = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        heapq.heappush(self._heap, (order, next(self._seq), rid))
        self.held_total += 1
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result():
                self.leave()  # let in, then cancelled before it ran: its row goes on
            if self._waiting.get(rid) is fut:
                del self._waiting[rid]
            raise

    def leave(self) -> None:
        """A path left the engine: its row goes to the oldest waiting path."""
        self.in_engine -= 1
        self.release()

    def release(self) -> None:
        """Let waiting paths in, oldest first, while rows are free (called
        when a path leaves; a caller may call it when other requests' rows free)."""
        limit = self._rows()
        while self._heap and self.in_engine < limit:
            _, _, rid = heapq.heappop(self._heap)
            fut = self._waiting.pop(rid, None)
            if fut is None or fut.done():
                continue  # dropped or cancelled while it waited
            self.in_engine += 1
            fut.set_result(True)
        if not self._waiting:
            self._heap.clear()

    def drop(self, rids: Iterable[str]) -> list[str]:
        """Paths a settled vote ends: those still waiting here never reach the
        engine (their streams end empty); the others are returned, to abort."""
        rest = []
        for rid in rids:
            fut = self._waiting.pop(rid, None)
            if fut is None:
                rest.append(rid)
            elif not fut.done():
                fut.set_result(False)
        return rest

    async def stream(self, rid: str, order: tuple,
                     open_stream: Callable[[], AsyncIterator[Any]]) -> AsyncIterator[Any]:
        """``open_stream()``'s outputs once ``rid`` has a row (``order``: oldest
        first); nothing if it is dropped first.  Its row is given back at its
        finished output, or when the stream ends or is cancelled."""
        if not await self._enter(rid, order):
            return
        inside = True
        try:
            async for out in open_stream():
                if out.finished and inside:  # a consumer may stop reading here
                    inside = False
                    self.leave()
                yield out
        finally:
            if inside:
                self.leave()
