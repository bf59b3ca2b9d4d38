"""What every self-consistency route does the same way: run a request's
paths against the server's engine (the run's count of paths in flight,
``X-Request-Id``, run-ahead over the engine's measured step cost, every
path of a prompt on one data-parallel engine), answer when done unless
the client went away first (then every path is aborted), stream
server-sent events, and shape errors as vLLM's routes do.

With ``--data-parallel-size`` D > 1 each path would go to whichever engine
vLLM's balancer picks, away from its siblings, and consensus drafting
drafts from siblings on its own engine.  So every path of a prompt is sent
with ``data_parallel_rank``: the client's ``X-data-parallel-rank`` header
(as vLLM's routes take it: an int in [0, D), else not used), or else
:func:`~consensus_spec.sampling.routing.data_parallel_rank` of its token ids."""

# no "from __future__ import annotations": FastAPI reads annotations of routes built here
import asyncio
import json
import logging
import time
import uuid
from typing import Any, Callable

from ..sampling.async_loop import TASK_PREFIX, run_paths_async
from ..sampling.routing import data_parallel_rank
from ..sampling.run_ahead import RunAhead
from .options import RunOptions

logger = logging.getLogger(f"vllm.{__name__}")

KEEPALIVE_S = 15.0  # an SSE comment this often while a stream has nothing to send


def error(status: int, message: str, param: str | None = None):
    from fastapi.responses import JSONResponse

    kind = {400: "BadRequestError", 404: "NotFoundError",
            503: "ServiceUnavailableError"}.get(status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status)


def new_run_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


async def serve(raw_request, prefix: str, handle: Callable):
    """What every route opens with: the server's state (503 without an
    engine), a run id (``prefix``), the JSON body (400 when it is not), then
    ``handle(st, run_id, body)``; the request's arrival stops counting for
    others' schedules once it is answered, whatever happened."""
    st = getattr(raw_request.app.state, "consensus_sc", None)
    if st is None:
        return error(503, "no engine behind this server", None)
    run_id = new_run_id(prefix)
    try:
        body = json.loads(await raw_request.body() or b"null")
    except (ValueError, UnicodeDecodeError) as e:
        return error(400, f"body: not valid JSON ({e})", "body")
    try:
        return await handle(st, run_id, body)
    finally:
        st.pending.pop(run_id, None)  # counted from its parse until its run chose its schedule


def _task(coro, route: str, role: str) -> asyncio.Task:
    """A task named as this package's (``GET .../state`` counts them)."""
    task = asyncio.ensure_future(coro)
    task.set_name(f"{TASK_PREFIX}{route} {role}")
    return task


def tasks_held() -> int:
    """This package's tasks alive in the running loop (requests' runs, their
    paths, disconnect watchers, stream readers): none once every request ended."""
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:  # no running loop: no task runs
        return 0
    return sum(t.get_name().startswith(TASK_PREFIX) for t in tasks)


async def run_request(st, raw_request, run_id: str, prompts: list, make_params: Callable,
                      n: int, opts: RunOptions, max_tokens: int, *,
                      on_vote: Callable | None = None, on_problem_done: Callable | None = None,
                      on_schedule: Callable | None = None,
                      keep_outputs: bool = False, priority: int = 0):
    """Sample and vote ``prompts`` (engine inputs) through the server's
    engine; the run is counted in ``st`` while it lasts.  Unless the
    request named a schedule, the engine's load picks it
    (:func:`~consensus_spec.sampling.load_policy.choose_schedule`);
    ``on_schedule(choice)`` sees the choice before any path is sent.
    Cancelling the run (a client that left) aborts every path it started."""
    started = time.monotonic()

    def problem_done(p: int, book) -> None:
        st.problem_answered(run_id, time.monotonic() - started)
        if on_problem_done is not None:
            on_problem_done(p, book)

    costs = st.costs  # the engine's step cost, measured in this process (step_costs.py)
    objective = "throughput" if st.run_ahead_mode == "throughput" else "latency"
    run_ahead = RunAhead(opts.stop_rule, costs, objective,
                         late=lambda: st.late(time.monotonic() - started)) \
        if st.measured_run_ahead else None

    def on_submit(count: int) -> None:
        if run_id in st.runs:  # a cancelled run's shielded clean-up may end after it left
            st.runs[run_id] += count

    dp = getattr(st, "data_parallel_size", 1)
    ranks: dict[int, int] = {}  # id(prompt) -> its engine

    def generate(rid, prompt, params):
        if dp <= 1:
            return st.engine.generate(prompt, params, rid, priority=priority)
        rank = ranks.get(id(prompt))
        if rank is None:
            rank = ranks[id(prompt)] = pinned if pinned is not None else \
                data_parallel_rank(list(prompt["prompt_token_ids"]), dp)
        return st.engine.generate(prompt, params, rid, priority=priority, data_parallel_rank=rank)

    pinned = _header_rank(raw_request, dp)
    # chosen and counted with no await before: requests arriving together see each other
    schedule, choice = st.schedule_for(run_id, opts, len(prompts), n)
    st.runs[run_id] = 0
    client_id = raw_request.headers.get("X-Request-Id")
    if client_id:
        st.client_ids[run_id] = client_id[:256]
    st.requests_total += 1
    try:
        if on_schedule is not None:
            on_schedule(choice)
        result = await run_paths_async(
            generate, st.engine.abort, prompts, make_params, n, schedule=schedule,
            stop_rule=opts.stop_rule, voting=opts.voting, max_tokens=max_tokens,
            run_id=run_id, on_vote=on_vote, on_problem_done=problem_done,
            on_submit=on_submit, idle_rows=lambda: st.idle_rows(run_id),
            on_start=lambda book: st.wants.__setitem__(run_id, book.planner.rows_wanted),
            run_ahead=run_ahead, keep_outputs=keep_outputs, prior=st.prior)
        st.stopping.add(result)
        return result
    except BaseException:
        st.requests_unfinished += 1
        raise
    finally:
        st.runs.pop(run_id, None)
        st.client_ids.pop(run_id, None)
        st.wants.pop(run_id, None)
        st.problems.pop(run_id, None)
        if run_ahead is not None:
            st.run_ahead_total.merge(run_ahead.stats)


def _header_rank(raw_request, dp: int) -> int | None:
    raw = raw_request.headers.get("X-data-parallel-rank") if dp > 1 else None
    try:
        rank = int(raw) if raw is not None else None
    except ValueError:
        return None
    return rank if rank is not None and 0 <= rank < dp else None


async def until_disconnect(raw_request, work, route: str):
    """Run ``work`` unless the client goes away first, then cancel it (the
    run aborts its paths); the body was read, so the disconnect listener may
    consume the request's messages (as vLLM's ``with_cancellation`` does)."""
    from fastapi.responses import JSONResponse
    from vllm.entrypoints.serve.utils.api_utils import listen_for_disconnect

    task = _task(work, route, "run")
    watcher = _task(listen_for_disconnect(raw_request), route, "disconnect watcher")
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if not task.done() or task.cancelled():
        return None  # the client is gone: nobody reads a response
    exc = task.exception()
    if exc is not None:
        logger.warning("consensus_spec: %s failed: %r", route, exc)
        return error(500, f"self-consistency run failed: {type(exc).__name__}")
    return JSONResponse(task.result())


def sse(run: Callable[[], Any], events: asyncio.Queue, finish: Callable[[Any], list],
        route: str):
    """Server-sent events: whatever the run puts on ``events`` as it goes,
    then ``finish(result)``'s events and ``[DONE]``; a comment line every
    ``KEEPALIVE_S`` while there is nothing to send (proxies and clients keep
    the connection).  Starlette cancels the generator when the client goes
    away; the run is cancelled with it."""
    from fastapi.responses import StreamingResponse

    def data(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def stream():
        task = _task(run(), route, "run")
        getter = None
        try:
            while True:
                getter = _task(events.get(), route, "stream reader")
                await asyncio.wait([getter, task], timeout=KEEPALIVE_S,
                                   return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield data(getter.result())
                    continue
                getter.cancel()
                if not task.done():
                    yield ": running\n\n"
                    continue
                while not events.empty():
                    yield data(events.get_nowait())
                exc = task.exception()
                if exc is not None:
                    logger.warning("consensus_spec: %s failed: %r", route, exc)
                    yield data({"error": {"message": "self-consistency run failed: "
                                                     f"{type(exc).__name__}",
                                          "type": "InternalServerError", "code": 500}})
                else:
                    for event in finish(task.result()):
                        yield data(event)
                yield "data: [DONE]\n\n"
                return
        finally:  # a client gone mid-wait leaves both pending: the reader would wait forever
            pending = [t for t in (task, getter) if t is not None and not t.done()]
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    return StreamingResponse(stream(), media_type="text/event-stream")
