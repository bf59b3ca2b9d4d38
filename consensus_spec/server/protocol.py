"""``POST /v1/self_consistency``: the request it takes and the JSON it returns.

Names shared with ``/v1/completions`` keep their meaning there (``model``,
``prompt``, ``n``, ``temperature``, ``top_p``, ``max_tokens``, ``seed``,
``stop``, ``stream``); the rest are the library's options
(:class:`~consensus_spec.sampling.stopping.StopRule`,
:class:`~consensus_spec.sampling.waves.Schedule`,
:class:`~consensus_spec.sampling.engine_loop.Voting`).  Parsing is strict:
unknown keys and wrong types are errors that name the field
(:class:`BadRequest`, answered 400); no vLLM import here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..sampling.engine_loop import Voting, resolve_stop_rule
from ..sampling.results import ProblemResult
from ..sampling.stopping import KINDS, StopRule
from ..sampling.waves import REST, Schedule
from ..voting.answers import DEFAULT_TIMEOUT_S

__all__ = ["BadRequest", "Limits", "SelfConsistencyRequest", "parse_request", "problem_json"]

MAX_SEED = 2**31  # seed + problem * n + path stays a small int
MAX_VOTE_TIMEOUT_S = 10.0  # per math-verify comparison: a client may not hold the server longer


class BadRequest(ValueError):
    """A request the endpoint refuses: ``param`` names the field."""

    def __init__(self, param: str, message: str, status: int = 400):
        super().__init__(f"{param}: {message}" if param else message)
        self.param, self.status = param, status


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server allows one request (set by the server's environment,
    see :mod:`consensus_spec.server.endpoint`)."""

    max_n: int = 64
    max_prompts: int = 64
    max_inflight: int = 128  # paths of one request in the engine at once
    idle_fill: str = "any"  # "any": idle rows to whichever run asks; "oldest": older runs first


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class StopRuleIn(_Strict):
    kind: Literal[KINDS] = "sequential"  # type: ignore[valid-type]
    error: float = StopRule.error
    min_samples: int = StopRule.min_samples
    window: int = StopRule.window
    margin: int = StopRule.margin


class ScheduleIn(_Strict):
    waves: list[Union[int, Literal["rest"]]] = Field(default_factory=lambda: [2], min_length=1)
    check: Literal["wave", "path"] = "wave"
    fill_idle: bool = True


class VotingIn(_Strict):
    weighted: bool = False
    weight_method: Literal["exp_mean", "softmax"] = "exp_mean"
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=MAX_VOTE_TIMEOUT_S)


class SelfConsistencyRequest(_Strict):
    model: str | None = None
    prompt: Union[str, list[str], None] = None
    messages: Union[list[Message], list[list[Message]], None] = None
    n: int = Field(16, ge=1)
    temperature: float = Field(0.8, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    stop: Union[str, list[str], None] = None
    # True: the library's default StopRule (sequential, error 0.2); a kind
    # name; a margin > 0; an object of StopRule fields; false/null: all n paths.
    early_stop: Union[bool, str, float, StopRuleIn, None] = True
    # "2", "4,4,rest", "all" (Schedule.parse), or an object; default: waves
    # of 2 with early stop, all at once without.
    schedule: Union[str, ScheduleIn, None] = None
    voting: VotingIn = Field(default_factory=VotingIn)
    return_paths: bool = False
    stream: bool = False


_UNION_TAGS = {"str", "int", "float", "bool", "none", "StopRuleIn", "ScheduleIn", "Message"}


def _field(loc: tuple) -> str:
    """pydantic's error location -> the request field (``early_stop.error``),
    without the union-member tags pydantic inserts (``str``, ``list[str]``)."""
    return ".".join(str(x) for x in loc
                    if not (isinstance(x, str) and (x in _UNION_TAGS or "[" in x)))


def _first_error(e: ValidationError) -> BadRequest:
    """The most specific error (deepest field); a union's type errors at one
    field are joined ("a valid boolean; a valid string; ...")."""
    errors = [(_field(err["loc"]) or "body", err["msg"]) for err in e.errors()]
    depth = max(f.count(".") for f, _ in errors)
    field = next(f for f, _ in errors if f.count(".") == depth)
    msgs = list(dict.fromkeys(m for f, m in errors if f == field))
    return BadRequest(field, "; ".join(msgs))


def parse_request(body: Any, limits: Limits) -> tuple[SelfConsistencyRequest, StopRule | None,
                                                      Schedule, Voting]:
    """JSON body -> (request, stop rule, schedule, voting); BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("body", f"must be a JSON object, got {type(body).__name__}")
    try:
        req = SelfConsistencyRequest.model_validate(body)
    except ValidationError as e:
        raise _first_error(e) from None
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

    early = req.early_stop
    try:
        if isinstance(early, StopRuleIn):
            stop_rule = StopRule(**early.model_dump())
        else:
            stop_rule = resolve_stop_rule(early)
    except ValueError as e:
        raise BadRequest("early_stop", str(e)) from None
    try:
        if req.schedule is None:
            schedule = None
        elif isinstance(req.schedule, str):
            schedule = Schedule.parse(req.schedule)
        else:
            schedule = Schedule(waves=tuple(req.schedule.waves), check=req.schedule.check,
                                fill_idle=req.schedule.fill_idle)
    except ValueError as e:
        raise BadRequest("schedule", str(e)) from None
    if schedule is None:
        schedule = Schedule() if stop_rule is not None else Schedule(waves=(REST,))
    schedule = dataclasses.replace(schedule, capacity=limits.max_inflight)
    voting = Voting(weighted=req.voting.weighted, weight_method=req.voting.weight_method,
                    timeout_s=req.voting.timeout_s)
    if stop_rule is not None and voting.weighted:
        raise BadRequest("voting.weighted", "stop rules count unweighted votes: "
                         "weighted voting needs early_stop=false")
    return req, stop_rule, schedule, voting


def is_many(req: SelfConsistencyRequest) -> bool:
    """A list of problems (a list of prompts, or a list of conversations)."""
    if req.prompt is not None:
        return isinstance(req.prompt, list)
    return bool(req.messages) and isinstance(req.messages[0], list)


def stop_reason(result: ProblemResult, n: int, stop_rule: StopRule | None) -> str:
    if result.stopped_early and result.stopped_after is not None:
        lead = result.vote.winner.count if result.vote.winner else 0
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
