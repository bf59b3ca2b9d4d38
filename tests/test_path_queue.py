"""The endpoint's queue in front of the engine (consensus_spec/server/path_queue.py):
paths enter a full batch oldest problem first, dropped ones never enter,
and every row is given back however a stream ends."""

import asyncio
from types import SimpleNamespace

from consensus_spec.server.path_queue import PathQueue


def _engine(log: list, steps: int = 3):
    """A fake engine stream: ``steps`` outputs, the last one finished."""
    def open_stream(rid):
        async def stream():
            log.append(rid)
            for i in range(steps):
                await asyncio.sleep(0)
                yield SimpleNamespace(finished=i == steps - 1)
        return stream
    return open_stream


async def _consume(queue, rid, order, open_stream, seen):
    async for out in queue.stream(rid, order, open_stream(rid)):
        seen.append((rid, out.finished))
        if out.finished:
            break  # as run_paths_async's reader does: the stream is left open


def test_idle_batch_sends_at_once_and_full_batch_lets_oldest_in_first():
    async def main():
        queue, log, seen = PathQueue(lambda: 2), [], []
        open_stream = _engine(log)
        # the newer run's paths are asked for first, the older run's after
        tasks = [asyncio.create_task(_consume(queue, f"new-{k}", (5, 0, k), open_stream, seen))
                 for k in range(3)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(_consume(queue, f"old-{k}", (1, 0, k), open_stream, seen))
                  for k in range(2)]
        await asyncio.gather(*tasks)
        return queue, log, seen

    queue, log, seen = asyncio.run(main())
    assert log[:2] == ["new-0", "new-1"]  # two rows free: no wait
    assert log[2:4] == ["old-0", "old-1"]  # then the older run, before new-2
    assert log[4] == "new-2"
    assert queue.in_engine == 0 and queue.waiting == 0 and queue.held_total == 3
    assert sum(f for _, f in seen) == 5


def test_dropped_paths_never_enter_and_cancelled_ones_give_back_their_row():
    async def main():
        queue, log, seen = PathQueue(lambda: 1), [], []
        open_stream = _engine(log, steps=50)
        first = asyncio.create_task(_consume(queue, "a-0", (0, 0, 0), open_stream, seen))
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(_consume(queue, f"b-{k}", (1, 0, k), open_stream, seen))
                   for k in range(3)]
        await asyncio.sleep(0)
        assert queue.waiting == 3 and queue.in_engine == 1
        rest = queue.drop(["b-0", "a-0"])  # b-0 waits: dropped here; a-0 runs: to abort
        assert rest == ["a-0"]
        waiting[1].cancel()  # a client gone: its waiting path leaves the queue
        first.cancel()  # and a running one gives its row back
        await asyncio.gather(first, *waiting, return_exceptions=True)
        return queue, log

    queue, log = asyncio.run(main())
    assert "b-0" not in log and "b-1" not in log
    assert log == ["a-0", "b-2"]
    assert queue.in_engine == 0 and queue.waiting == 0
