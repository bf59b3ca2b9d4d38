"""The engine loop of self-consistency for an async engine client.

:func:`run_paths_async` is :func:`~consensus_spec.sampling.engine_loop.run_paths`
for engines that stream each request's outputs as an async iterator, as
vLLM's ``AsyncLLM`` / ``EngineClient`` does (``generate(prompt, params,
request_id)`` and ``abort(request_ids)``): the same
:class:`~consensus_spec.sampling.path_book.PathBook` (planner, stop rule,
vote), fed by one task per running path instead of an engine step loop.
Other requests may share the engine: only this run's ids are touched.

Every path this run started is aborted before it returns or raises, a
cancellation (a client that went away) included.  Paths may stream DELTA
outputs or only their final output (FINAL_ONLY: far less work per engine
step for the server); an aborted path's tokens are then read from the final
output the engine sends when it aborts a request.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Sequence

from .options import LoopOptions
from .path_book import PathBook
from .results import SelfConsistencyRun

__all__ = ["run_paths_async", "TASK_PREFIX"]

TASK_PREFIX = "consensus_spec "  # the names of the tasks a run starts (a server counts them)
ABORT_DRAIN_S = 1.0  # how long aborted paths may take to hand in their final output

Generate = Callable[[str, Any, Any], AsyncIterator[Any]]  # (request id, prompt, params)
Abort = Callable[[Iterable[str]], Awaitable[None]]


async def run_paths_async(
    generate: Generate,
    abort: Abort,
    prompts: Sequence[Any],
    make_params: Callable[[int, int], Any],
    n: int,
    options: LoopOptions | None = None,
    *,
    run_id: str | None = None,
    on_vote: Callable[[int, list, int, bool], None] | None = None,
    on_problem_done: Callable[[int, PathBook], None] | None = None,
    on_submit: Callable[[int], None] | None = None,
    idle_rows: Callable[[], int] | None = None,
    on_start: Callable[[PathBook], None] | None = None,
    run_ahead: Any = None,
    keep_outputs: bool = False,
    **option_fields: Any,
) -> SelfConsistencyRun:
    """Sample up to ``n`` paths per prompt through ``generate``, in waves, and vote.

    ``make_params(problem, path)`` asks for DELTA outputs (``delta=True``)
    or FINAL_ONLY ones; with FINAL_ONLY an aborted path's tokens come from
    the final output vLLM's ``AsyncLLM`` sends on abort.  ``options``: the
    run's :class:`~consensus_spec.sampling.options.LoopOptions`, or its
    fields as keywords, as in :func:`~consensus_spec.sampling.engine_loop.run_paths`;
    ``schedule.capacity`` bounds this run's paths in flight.  ``on_vote``
    sees every stop vote (see :class:`PathBook`), ``on_problem_done(problem,
    book)`` each problem once its vote is final, ``on_submit(count)`` each
    batch of paths sent (for a caller's count of in-flight requests;
    negative when they end).
    ``idle_rows()``: engine rows idle now, for an engine shared with other
    runs (see :class:`~consensus_spec.sampling.waves.PathPlanner`);
    ``on_start(book)`` sees the run's :class:`PathBook` before any path is sent;
    ``run_ahead`` (a :class:`~consensus_spec.sampling.run_ahead.RunAhead`)
    decides which later waves idle rows start early; ``keep_outputs``
    keeps each path's token ids and logprobs (a server keeps one ``prior``
    for all its runs).
    """
    opts = LoopOptions.of(options, option_fields, "run_paths_async")
    delta = opts.delta
    book = PathBook(len(prompts), n, opts.schedule, opts.stop_rule, opts.voting, opts.max_tokens,
                    on_vote, idle_rows, run_ahead, keep_outputs, opts.prior)
    if on_start is not None:
        on_start(book)
    run_id = run_id or uuid.uuid4().hex[:12]
    rid = lambda p, k: f"{run_id}-{p}-{k}"  # noqa: E731
    events: asyncio.Queue = asyncio.Queue()
    tasks: dict[tuple[int, int], asyncio.Task] = {}

    async def consume(key: tuple[int, int]) -> None:
        p, k = key
        try:
            async for out in generate(rid(p, k), prompts[p], make_params(p, k)):
                book.update(key, out.outputs[0], delta)
                if out.finished:
                    break
            events.put_nowait((key, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the run, which re-raises it
            events.put_nowait((key, e))

    def submit(paths: list[tuple[int, int]]) -> None:
        for key in paths:
            tasks[key] = asyncio.create_task(consume(key), name=f"{TASK_PREFIX}{rid(*key)}")
        if paths and on_submit is not None:
            on_submit(len(paths))

    async def stop(keys: list[tuple[int, int]]) -> None:
        """Abort ``keys``; their tasks read the final output the abort sends
        (its tokens), and any still waiting after a moment are cancelled
        (a cancelled ``generate`` aborts its request itself)."""
        stopped = [tasks.pop(key) for key in keys if key in tasks]
        if keys:
            await abort([rid(p, k) for p, k in keys])
        if stopped:
            _, late = await asyncio.wait(stopped, timeout=ABORT_DRAIN_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*stopped, return_exceptions=True)
            if on_submit is not None:
                on_submit(-len(stopped))

    t0 = time.perf_counter()
    try:
        submit(book.admit())
        while tasks:
            key, error = await events.get()
            if error is not None:
                raise error
            if tasks.pop(key, None) is None:
                continue  # aborted after it had finished
            if on_submit is not None:
                on_submit(-1)
            to_submit, to_abort = book.finish(key)
            await stop(to_abort)
            submit(to_submit)
            if on_problem_done is not None and book.done(key[0]):
                on_problem_done(key[0], book)
            if not tasks:
                submit(book.admit())
    finally:
        if tasks:  # error or cancellation: nothing keeps running for this run
            await asyncio.shield(stop(list(tasks)))
    return book.run(time.perf_counter() - t0)
