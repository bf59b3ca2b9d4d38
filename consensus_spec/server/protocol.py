"""``POST /v1/self_consistency``: the request it takes and the JSON it returns.

Names shared with ``/v1/completions`` keep their meaning there (``model``,
``prompt``, ``n``, ``temperature``, ``top_p``, ``max_tokens``, ``seed``,
``stop``, ``stream``); the rest are the library's options
(:class:`~consensus_spec.sampling.stopping.StopRule`,
:class:`~consensus_spec.sampling.waves.Schedule`,
:class:`~consensus_spec.sampling.options.Voting`).  Parsing is strict:
unknown keys and wrong types are errors that name the field
(:class:`BadRequest`, answered 400); no vLLM import here.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field, ValidationError

from ..sampling.results import ProblemResult
from ..sampling.stopping import StopRule
from .options import BadRequest, Limits, RunOptions, Strict, first_error, resolve_options, split_options

__all__ = ["BadRequest", "Limits", "SelfConsistencyRequest", "parse_request", "problem_json"]

MAX_SEED = 2**31  # seed + problem * n + path stays a small int


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class SelfConsistencyRequest(Strict):
    model: str | None = None
    prompt: Union[str, list[str], None] = None
    messages: Union[list[Message], list[list[Message]], None] = None
    n: int = Field(16, ge=1)
    temperature: float = Field(0.8, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    stop: Union[str, list[str], None] = None
    stream: bool = False


def parse_request(body: Any, limits: Limits,
                  defaults: dict | None = None) -> tuple[SelfConsistencyRequest, RunOptions]:
    """JSON body -> (request, run options); BadRequest naming the field.
    ``defaults``: the server's option fields (see :mod:`.options`)."""
    if not isinstance(body, dict):
        raise BadRequest("body", f"must be a JSON object, got {type(body).__name__}")
    rest, opts = split_options(body, defaults or {})
    try:
        req = SelfConsistencyRequest.model_validate(rest)
    except ValidationError as e:
        raise first_error(e) from None
    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("prompt", "send exactly one of prompt and messages")
    field = "prompt" if req.prompt is not None else "messages"
    items = req.prompt if req.prompt is not None else req.messages
    if not items or (isinstance(items, list) and not all(items)):
        raise BadRequest(field, "must not be empty")
    count = len(items) if is_many(req) else 1
    if count > limits.max_prompts:
        raise BadRequest(field, f"{count} problems; this server takes at most "
                                f"{limits.max_prompts} a request")
    if req.n > limits.max_n:
        raise BadRequest("n", f"{req.n} paths; this server allows at most {limits.max_n}")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > 16 or any(not s for s in stops):
        raise BadRequest("stop", "at most 16 non-empty strings")
    if req.seed is not None and req.seed + count * req.n >= MAX_SEED:
        raise BadRequest("seed", f"seed + problems * n must stay below {MAX_SEED}")
    return req, resolve_options(opts, limits)


def is_many(req: SelfConsistencyRequest) -> bool:
    """A list of problems (a list of prompts, or a list of conversations)."""
    if req.prompt is not None:
        return isinstance(req.prompt, list)
    return bool(req.messages) and isinstance(req.messages[0], list)


def stop_reason(result: ProblemResult, n: int, stop_rule: StopRule | None) -> str:
    if result.stopped_early and result.stopped_after is not None:
        lead = result.vote.winner.count if result.vote.winner else 0
        if result.decided:
            return (f"{stop_rule.describe()}: decided after {result.stopped_after} of {n} paths "
                    f"({lead} for the answer; the other {n - result.stopped_after} could not "
                    "change it)")
        return (f"{stop_rule.describe()}: stopped after {result.stopped_after} of {n} paths "
                f"({lead} for the answer)")
    if stop_rule is None:
        return f"early stop off: all {n} paths"
    return f"{stop_rule.describe()}: never settled; all {n} paths"


def problem_json(result: ProblemResult, n: int, stop_rule: StopRule | None,
                 return_paths: bool) -> dict:
    """One problem's answer, vote and costs as the endpoint returns them."""
    vote = result.vote
    out = {
        "answer": vote.answer,
        "agreement": round(vote.agreement, 6),
        "count": vote.winner.count if vote.winner else 0,
        "votes": [{"answer": c.answer, "count": c.count} for c in vote.classes],
        "abstained": vote.num_abstained,
        "paths_sampled": result.num_sent,  # sent to the engine
        "paths_finished": len(result.samples),
        "paths_stopped": result.num_aborted,  # cancelled by early stop, running or never sent
        "paths_ended_in_flight": result.ended_in_flight,  # of those, the ones that were running
        "stopped_early": result.stopped_early,
        "stop_reason": stop_reason(result, n, stop_rule),
        "waves": result.waves,
        "tokens": result.num_tokens,  # generated, aborted paths' tokens included
        "tokens_discarded": result.aborted_tokens,
        "tokens_saved_estimate": result.est_tokens_saved,  # vs running all n paths
    }
    if vote.total_weight and any(c.weight != c.count for c in vote.classes):  # weighted voting
        for entry, c in zip(out["votes"], vote.classes):
            entry["weight"] = round(c.weight, 6)
    if return_paths:
        out["paths"] = [{"index": s.path, "text": s.text, "answer": s.answer,
                         "finish_reason": s.finish_reason, "tokens": s.num_tokens}
                        for s in result.samples]
    return out
