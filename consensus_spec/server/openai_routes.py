"""``POST /v1/self_consistency/completions`` and ``.../chat/completions``:
any OpenAI client becomes a self-consistency client by pointing its
``base_url`` at ``http://host:port/v1/self_consistency``.

A thin room: the request is parsed (:mod:`.openai_protocol`), rendered by
vLLM's own renderer (the chat template, token-id prompts, truncation and
length checks of ``/v1/completions`` and ``/v1/chat/completions``), its
sampling parameters are the request's own, and its paths run through
:mod:`.runs` like every self-consistency route's.
"""

# no "from __future__ import annotations": FastAPI reads the route's Request annotation
import asyncio
import time

from .openai_protocol import (CHAT, COMPLETION, choices_json, num_prompts, parse_openai,
                              path_params, response_json, stream_chunks, usage_chunk)
from .options import BadRequest
from .runs import error, run_request, serve, sse, until_disconnect


def attach(app, base: str) -> None:
    from fastapi import Request

    @app.post(base + "/completions")
    async def self_consistency_completions(raw_request: Request):
        return await handle(raw_request, COMPLETION)

    @app.post(base + "/chat/completions")
    async def self_consistency_chat_completions(raw_request: Request):
        return await handle(raw_request, CHAT)


def _vllm_error(e: Exception):
    """A vLLM exception (VLLMValidationError and kin) as vLLM's routes answer it."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    info = create_error_response(e).error
    return error(int(info.code), info.message, info.param)


async def _render(st, req, kind: str) -> list:
    """Engine inputs, one per prompt, from vLLM's renderer; BadRequest for
    what it refuses (its ``input_tokens`` named as the field sent)."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.exceptions import VLLMError

    if st.renderer is None:
        raise BadRequest("", "this server has no request renderer (vLLM's OnlineRenderer)", 503)
    try:
        out = await (st.renderer.render_chat(req) if kind == CHAT
                     else st.renderer.render_completion(req))
    except VLLMError as e:
        out = create_error_response(e)
    info = getattr(out, "error", None)
    if info is not None:  # vLLM's ErrorResponse
        param = info.param
        if param in (None, "input_tokens"):
            param = "messages" if kind == CHAT else "prompt"
        raise BadRequest(param, info.message, int(info.code))
    return out[1] if kind == CHAT else out


async def handle(raw_request, kind: str):
    return await serve(raw_request, "chatcmpl-sc" if kind == CHAT else "cmpl-sc",
                       lambda st, run_id, body: _handle(raw_request, kind, st, run_id, body))


async def _handle(raw_request, kind: str, st, run_id: str, body):
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
    from vllm.exceptions import VLLMError

    route = raw_request.url.path
    try:
        req, opts = parse_openai(body, kind, st.limits, st.defaults)
        if req.model is not None and req.model not in st.model_names:
            return error(404, f"The model `{req.model}` does not exist.", "model")
        st.arrived(run_id, num_prompts(req, kind), req.n or 1)
        inputs = await _render(st, req, kind)
        prompts = [list(x["prompt_token_ids"]) for x in inputs]
        asked = req.max_tokens
        if kind == CHAT and req.max_completion_tokens is not None:
            asked = req.max_completion_tokens
        limits = [get_max_tokens(st.max_model_len, asked, len(ids), st.default_sampling_params,
                                 st.override_max_tokens,
                                 truncate_prompt_tokens=req.truncate_prompt_tokens)
                  for ids in prompts]
        bases = [req.to_sampling_params(m, st.default_sampling_params) for m in limits]
        weighted = opts.voting.weighted

        def make_params(p: int, k: int):
            params = path_params(bases[p], req, p, k)
            if weighted and params.logprobs is None:
                params.logprobs = 0  # the vote's weights need each path's logprob
            return params

        make_params(0, 0)
    except BadRequest as e:
        return error(e.status, str(e), e.param)
    except VLLMError as e:
        return _vllm_error(e)
    except ValueError as e:  # SamplingParams' and get_max_tokens' checks
        return error(400, str(e), getattr(e, "parameter", None))

    n = req.n or 1
    created = int(time.time())
    model = req.model or (st.model_names[0] if st.model_names else "")
    wants_logprobs = bool(req.logprobs) if kind == CHAT else req.logprobs is not None
    keep = wants_logprobs or bool(getattr(req, "return_token_ids", False))
    tokenizer = st.engine.renderer.get_tokenizer() if keep else None
    prompt_tokens = sum(len(ids) for ids in prompts)
    events: asyncio.Queue | None = asyncio.Queue() if req.stream else None
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    used: dict = {}  # the schedule the run chose (each vote's schedule_used)

    def choices(p: int, result) -> list[dict]:
        return choices_json(kind, p, result, req, opts, tokenizer, prompts[p], used)

    def on_problem_done(p: int, book) -> None:
        if events is not None:
            for choice in choices(p, book.result(p)):
                for chunk in stream_chunks(kind, run_id, model, created, choice):
                    events.put_nowait(chunk)

    async def run():
        return await run_request(st, raw_request, run_id, inputs, make_params, n, opts,
                                 max(limits), on_problem_done=on_problem_done,
                                 on_schedule=lambda choice: used.update(choice.as_dict()),
                                 keep_outputs=keep, priority=req.priority)

    if req.stream:
        def finish(result) -> list:
            if not include_usage:
                return []
            return [usage_chunk(kind, run_id, model, created, prompt_tokens, result.num_tokens)]
        return sse(run, events, finish, route)

    async def respond() -> dict:
        result = await run()
        return response_json(kind, run_id, model, [c for p, r in enumerate(result) for c in choices(p, r)],
                             prompt_tokens, result.num_tokens, created)

    return await until_disconnect(raw_request, respond(), route)
