"""``/v1/self_consistency/completions`` and ``.../chat/completions``: the
OpenAI request shapes in, the OpenAI response shapes out.

A request is parsed by vLLM's own ``CompletionRequest`` /
``ChatCompletionRequest``, so every field those routes accept is accepted
and means what it means there, and its sampling parameters come from the
request's own ``to_sampling_params``.  What changes:

- ``choices="vote"`` (the default but for chat with n > 1): ``n`` is the
  most paths a problem samples, early stop may end it sooner, and the
  response has one choice per prompt (``index`` i for prompt i), the voted
  answer's representative path: its text, finish reason and, if asked,
  logprobs and token ids.  What lm-eval reads (one choice a prompt).
- ``choices="paths"`` (the default for chat with n > 1: lighteval, litellm
  and the ``openai`` client read n choices as n samples): all n paths run,
  and each is a choice, the voted one first; metrics over every path
  (pass@k, avg@n) then see n real samples, never one vote counted n ways.
- ``seed`` seeds path k of prompt i with ``seed + i * n + k``: copies of one
  prompt never repeat each other (vLLM gives seeded copies the same text).
- ``usage.completion_tokens`` counts every token generated, the paths
  early stop cut off included.
- each choice carries the vote in one extra field, ``self_consistency``
  (``representative_path``: the path the choice shows).
- the run's options come as extra fields (:mod:`.options`); any other field
  the vLLM route does not know is a 400 naming it, and so are the fields
  that do not apply to a vote over paths (:data:`NOT_APPLICABLE`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pydantic import ValidationError

from ..sampling.options import parse_stop_rule
from ..sampling.results import ProblemResult, Sample
from .options import BadRequest, Limits, RunOptions, resolve_options, split_options
from .protocol import problem_json

__all__ = ["CHAT", "COMPLETION", "NOT_APPLICABLE", "choice_json", "choices_json", "parse_openai",
           "representative"]

COMPLETION, CHAT = "completion", "chat"
INT64_MAX = 2**63 - 1

# field -> why it does not apply; refused when set to anything but its default
NOT_APPLICABLE = {
    "echo": "echo returns the prompt; send it to /v1/completions",
    "use_beam_search": "beam search keeps one beam set, there is nothing to vote on",
    "prompt_logprobs": "prompt logprobs are the same for every path; ask /v1/completions",
    "prompt_embeds": "paths are drafted from token ids: send a text or token prompt",
    "logprob_token_ids": "not supported here: ask for logprobs (top-k)",
    "kv_transfer_params": "disaggregated prefill is not supported here",
    "ec_transfer_params": "disaggregated encoding is not supported here",
    "return_mm_kwargs": "multimodal inputs are not supported here",
    "tools": "tool calls are not voted on: use /v1/chat/completions",
}


def _request_class(kind: str):
    if kind == CHAT:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        return ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    return CompletionRequest


def _known_fields(cls) -> set[str]:
    names = set()
    for name, field in cls.model_fields.items():
        names.add(name)
        if field.alias:
            names.add(field.alias)
    return names


def _validation_error(e: ValidationError) -> BadRequest:
    """pydantic's first error -> BadRequest; vLLM's own validators raise
    VLLMValidationError naming the parameter, which pydantic wraps."""
    err = e.errors()[0]
    cause = (err.get("ctx") or {}).get("error")
    param = getattr(cause, "parameter", None)
    if param is None:
        param = ".".join(str(x) for x in err["loc"] if not (isinstance(x, str) and "[" in x)) \
            or "body"
    message = str(cause) if cause is not None else err["msg"]
    return BadRequest(param, message)


def parse_openai(body: Any, kind: str, limits: Limits, defaults: dict):
    """JSON body -> (vLLM's request object, run options); BadRequest naming
    the field.  Rendering (chat template, token ids, lengths) is left to
    vLLM's renderer."""
    if not isinstance(body, dict):
        raise BadRequest("body", f"must be a JSON object, got {type(body).__name__}")
    rest, opts = split_options(body, defaults)
    cls = _request_class(kind)
    unknown = sorted(set(rest) - _known_fields(cls))
    if unknown:
        raise BadRequest(unknown[0], f"unknown field; this route takes {cls.__name__}'s fields "
                                     "and the self-consistency options "
                                     "early_stop, schedule, voting, answer_pattern, return_paths, "
                                     "choices")
    from vllm.exceptions import VLLMError

    try:
        req = cls.model_validate(rest)
    except ValidationError as e:
        raise _validation_error(e) from None
    except (VLLMError, ValueError) as e:  # vLLM's validators raise their own errors
        raise BadRequest(getattr(e, "parameter", None) or "body", str(e)) from None
    for name, why in NOT_APPLICABLE.items():
        if name in req.model_fields_set and getattr(req, name, None) not in (None, False, [], {}):
            raise BadRequest(name, f"does not apply to self-consistency: {why}")
    if kind == CHAT and getattr(req, "tool_choice", None) not in (None, "none"):
        raise BadRequest("tool_choice", "does not apply to self-consistency: tool calls are "
                                        "not voted on")
    n = 1 if req.n is None else req.n
    if n < 1:
        raise BadRequest("n", f"must be >= 1, got {n}")
    if n > limits.max_n:
        raise BadRequest("n", f"{n} paths; this server allows at most {limits.max_n}")
    count = num_prompts(req, kind)
    if count > limits.max_prompts:
        raise BadRequest("prompt", f"{count} prompts; this server takes at most "
                                   f"{limits.max_prompts} a request")
    if req.seed is not None and req.seed + count * n > INT64_MAX:
        raise BadRequest("seed", "seed + prompts * n must fit in 64 bits")
    choices = opts.choices or ("paths" if kind == CHAT and n > 1 else "vote")
    if choices == "paths":  # every path runs: no stop, one wave
        for name in ("early_stop", "schedule"):
            if not _off(name, body.get(name)):
                raise BadRequest(name, "choices='paths' returns every path, so all n run at "
                                       "once: ask choices='vote' for one early-stopped vote")
        opts = opts.model_copy(update={"early_stop": False, "schedule": None})
    options = resolve_options(opts, limits)
    return req, dataclasses.replace(options, choices=choices)


def _off(name: str, value) -> bool:
    """Whether a body's ``early_stop`` or ``schedule`` asks for nothing
    (absent, false, or a stop rule that parses to off, e.g. ``"off"``)."""
    if value is None or value is False:
        return True
    if name != "early_stop":
        return False
    try:
        return parse_stop_rule(value) is None
    except ValueError:
        return False


def num_prompts(req, kind: str) -> int:
    if kind == CHAT:
        return 1
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def path_params(base, req, p: int, k: int):
    """Path k of prompt p: the request's own sampling parameters, one path,
    its own seed, the final output only (no output object per step)."""
    from vllm.sampling_params import RequestOutputKind

    params = base.clone()
    params.n = 1
    params.output_kind = RequestOutputKind.FINAL_ONLY
    if req.seed is not None:
        params.seed = req.seed + p * (req.n or 1) + k
    return params


def representative(result: ProblemResult) -> Sample | None:
    """The path a choice shows: one whose answer is the voted one, a path
    that ended by itself before one cut at max_tokens, then the lowest
    index; without a winner, the first finished path."""
    samples = result.samples
    if not samples:
        return None
    vote = result.vote
    pool = samples
    if vote.winner is not None:
        members = set(vote.winner.members)
        pool = [s for i, s in enumerate(samples) if i in members] or samples
    return min(pool, key=lambda s: (s.finish_reason != "stop", s.path))


def vote_json(result: ProblemResult, n: int, opts: RunOptions, rep: Sample | None,
              first_seed: int | None, schedule_used: dict | None = None) -> dict:
    out = problem_json(result, n, opts.stop_rule, opts.return_paths)
    out["early_stop"] = opts.stop_rule.describe() if opts.stop_rule else "off"
    out["schedule"] = schedule_used["schedule"] if schedule_used else opts.schedule.describe()
    out["schedule_used"] = schedule_used  # how the engine's load chose it
    out["representative_path"] = None if rep is None else rep.path
    out["distinct_texts"] = len({s.text for s in result.samples})  # of the finished paths
    # path k ran with seed first_seed + k (None: unseeded)
    out["seeds"] = None if first_seed is None else [first_seed, first_seed + result.num_sent - 1]
    return out


def _completion_logprobs(sample: Sample, tokenizer, as_ids: bool) -> dict | None:
    if not sample.logprobs or sample.token_ids is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for tid, position in zip(sample.token_ids, sample.logprobs):
        entry = position.get(tid) if position else None
        text = _token_text(tid, entry, tokenizer, as_ids)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        token_logprobs.append(None if entry is None else max(entry.logprob, -9999.0))
        top.append(None if not position else
                   {_token_text(t, lp, tokenizer, as_ids): max(lp.logprob, -9999.0)
                    for t, lp in position.items()})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def _chat_logprobs(sample: Sample, tokenizer, top_n: int, as_ids: bool) -> dict | None:
    if not sample.logprobs or sample.token_ids is None:
        return None
    content = []
    for tid, position in zip(sample.token_ids, sample.logprobs):
        entry = position.get(tid) if position else None
        text = _token_text(tid, entry, tokenizer, as_ids)
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank or 0) if position else []
        content.append({"token": text, "logprob": -9999.0 if entry is None else
                        max(entry.logprob, -9999.0), "bytes": list(text.encode("utf-8")),
                        "top_logprobs": [{"token": (t := _token_text(i, lp, tokenizer, as_ids)),
                                          "logprob": max(lp.logprob, -9999.0),
                                          "bytes": list(t.encode("utf-8"))}
                                         for i, lp in ranked[:top_n]]})
    return {"content": content}


def _token_text(tid: int, entry, tokenizer, as_ids: bool) -> str:
    if as_ids:
        return f"token_id:{tid}"
    text = getattr(entry, "decoded_token", None)
    if text is None and tokenizer is not None:
        text = tokenizer.decode([tid])
    return text or ""


def choices_json(kind: str, p: int, result: ProblemResult, req, opts: RunOptions,
                 tokenizer, prompt_ids: list[int], schedule_used: dict | None = None) -> list[dict]:
    """Prompt ``p``'s choices: with ``choices="vote"`` one, the voted path
    (index ``p``); with ``"paths"`` every path, the voted one first (indices
    p * n ...), as OpenAI numbers n choices of several prompts."""
    rep = representative(result)
    if opts.choices != "paths":
        return [choice_json(kind, p, p, result, req, opts, tokenizer, prompt_ids, rep,
                            schedule_used)]
    n = req.n or 1
    order = ([rep] if rep else []) + [s for s in result.samples if s is not rep]
    return [choice_json(kind, p * n + j, p, result, req, opts, tokenizer, prompt_ids, s,
                        schedule_used) for j, s in enumerate(order)]


def choice_json(kind: str, index: int, p: int, result: ProblemResult, req, opts: RunOptions,
                tokenizer, prompt_ids: list[int], rep: Sample | None,
                schedule_used: dict | None = None) -> dict:
    """Choice ``index`` of the response, prompt ``p``'s path ``rep``, with the vote."""
    as_ids = bool(getattr(req, "return_tokens_as_token_ids", False))
    text = rep.text if rep else ""
    out: dict[str, Any] = {"index": index}
    if kind == CHAT:
        out["message"] = {"role": "assistant", "content": text}
        top_n = getattr(req, "top_logprobs", 0) or 0
        out["logprobs"] = _chat_logprobs(rep, tokenizer, top_n, as_ids) \
            if rep and req.logprobs else None
    else:
        out["text"] = text
        out["logprobs"] = _completion_logprobs(rep, tokenizer, as_ids) \
            if rep and req.logprobs is not None else None
    out["finish_reason"] = rep.finish_reason if rep else "abort"
    out["stop_reason"] = rep.stop_reason if rep else None
    if getattr(req, "return_token_ids", False):
        out["token_ids"] = list(rep.token_ids or []) if rep else []
        out["prompt_token_ids"] = list(prompt_ids)
    n = req.n or 1
    first_seed = None if req.seed is None else req.seed + p * n
    out["self_consistency"] = vote_json(result, n, opts, rep, first_seed, schedule_used)
    return out


def response_json(kind: str, run_id: str, model: str, choices: list[dict],
                  prompt_tokens: int, completion_tokens: int, created: int | None = None) -> dict:
    return {"id": run_id, "object": "chat.completion" if kind == CHAT else "text_completion",
            "created": created or int(time.time()), "model": model, "choices": choices,
            "usage": usage_json(prompt_tokens, completion_tokens)}


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def stream_chunks(kind: str, run_id: str, model: str, created: int, choice: dict) -> list[dict]:
    """A finished choice as OpenAI streams it: its text in one chunk, then a
    chunk with its finish reason and the vote."""
    obj = "chat.completion.chunk" if kind == CHAT else "text_completion"
    head = {"id": run_id, "object": obj, "created": created, "model": model}
    index = choice["index"]
    if kind == CHAT:
        first = {"index": index, "delta": {"role": "assistant",
                                           "content": choice["message"]["content"]},
                 "logprobs": choice["logprobs"], "finish_reason": None}
        last = {"index": index, "delta": {}, "logprobs": None}
    else:
        first = {"index": index, "text": choice["text"], "logprobs": choice["logprobs"],
                 "finish_reason": None}
        last = {"index": index, "text": "", "logprobs": None}
    if "token_ids" in choice:
        first["token_ids"] = choice["token_ids"]
    last.update(finish_reason=choice["finish_reason"], stop_reason=choice["stop_reason"],
                self_consistency=choice["self_consistency"])
    return [{**head, "choices": [first]}, {**head, "choices": [last]}]


def usage_chunk(kind: str, run_id: str, model: str, created: int, prompt_tokens: int,
                completion_tokens: int) -> dict:
    obj = "chat.completion.chunk" if kind == CHAT else "text_completion"
    return {"id": run_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage_json(prompt_tokens, completion_tokens)}
