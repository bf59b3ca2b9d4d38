"""What every self-consistency route takes beyond its sampling request: the
run's options (stop rule, waves, voting, the answer pattern), the server's
limits and defaults, and the one error type (no vLLM import here).

The options are extra body fields on each route (the ``openai`` client's
``extra_body``, lm-eval's ``--gen_kwargs``): ``early_stop``, ``schedule``,
``voting``, ``answer_pattern``, ``return_paths``, and on the OpenAI-shaped
routes ``choices`` (what comes back: the vote, or every path).  A server sets its own
defaults for them at start-up (``CONSENSUS_SPEC_SC_DEFAULTS``, a JSON
object of the same fields); a request's fields replace them field by field.
Parsing is strict: unknown keys and wrong types are a :class:`BadRequest`
naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..sampling.options import Voting, check_voting, resolve_schedule, resolve_stop_rule
from ..sampling.stopping import KINDS, StopRule
from ..sampling.waves import Schedule
from ..voting.answers import DEFAULT_TIMEOUT_S, extract_final_answer
from ..voting.patterns import AnswerPattern

__all__ = ["BadRequest", "Limits", "OPTION_FIELDS", "RunOptions", "RunOptionsIn",
           "first_error", "parse_defaults", "resolve_options", "split_options"]

MAX_VOTE_TIMEOUT_S = 10.0  # per math-verify comparison: a client may not hold the server longer
OPTION_FIELDS = ("early_stop", "schedule", "voting", "answer_pattern", "return_paths", "choices")
CHOICES = ("vote", "paths")


class BadRequest(ValueError):
    """A request a route refuses: ``param`` names the field."""

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
    idle_fill: str = "oldest"  # "oldest": idle rows to older runs first; "any": to whichever asks


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StopRuleIn(Strict):
    kind: Literal[KINDS] = StopRule.kind  # type: ignore[valid-type]
    error: Optional[float] = None  # None: the kind's own default, as StopRule
    min_samples: Optional[int] = None
    window: Optional[int] = None
    margin: int = StopRule.margin
    forecast: bool = False  # bayes: also vote on running paths (their outputs then stream per step)


class ScheduleIn(Strict):
    waves: list[Union[int, Literal["rest"]]] = Field(default_factory=lambda: [2], min_length=1)
    check: Literal["index", "wave", "path"] = "index"
    fill_idle: bool = True


class VotingIn(Strict):
    weighted: bool = False
    weight_method: Literal["exp_mean", "softmax", "confidence"] = "exp_mean"
    confidence_keep: float = Field(0.9, gt=0, le=1)
    confidence_window: int = Field(16, ge=1, le=4096)
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=MAX_VOTE_TIMEOUT_S)


class AnswerPatternIn(Strict):
    pattern: str
    select: int = 0  # 0: the first match, -1: the last (lm-eval's group_select)


class RunOptionsIn(Strict):
    # True: the library's default StopRule (bayes, error 0.002); a kind
    # name; a margin > 0; an object of StopRule fields; false/null: all n paths.
    early_stop: Union[bool, str, float, StopRuleIn, None] = True
    # "2", "4,4,rest", "all" (Schedule.parse), or an object; default: with early
    # stop the engine's load picks waves of 2 or all at once; without, all at once.
    schedule: Union[str, ScheduleIn, None] = None
    voting: VotingIn = Field(default_factory=VotingIn)
    # a regex (lm-eval's regex_pattern) or {pattern, select}; default: the
    # answer a path states as final (boxed, ####, "the answer is"), or none
    answer_pattern: Union[str, AnswerPatternIn, None] = None
    return_paths: bool = False
    # OpenAI-shaped routes: "vote" (one choice a prompt: the voted path, early
    # stop) or "paths" (n choices a prompt: every path, all run); default:
    # "paths" for chat with n > 1 (a client that reads n choices), else "vote"
    choices: Optional[Literal[CHOICES]] = None  # type: ignore[valid-type]


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """The options resolved: what :func:`~consensus_spec.sampling.async_loop.run_paths_async` takes."""

    stop_rule: StopRule | None
    schedule: Schedule  # with schedule_auto, the waves the engine's load may choose
    voting: Voting
    return_paths: bool
    choices: str | None = None
    # no schedule named (request or server defaults) and a stop rule: the engine's load picks
    # waves or every path at once (consensus_spec.sampling.load_policy)
    schedule_auto: bool = False


_UNION_TAGS = {"str", "int", "float", "bool", "none", "StopRuleIn", "ScheduleIn", "Message",
               "AnswerPatternIn"}


def _field(loc: tuple) -> str:
    """pydantic's error location -> the request field (``early_stop.error``),
    without the union-member tags pydantic inserts (``str``, ``list[str]``)."""
    return ".".join(str(x) for x in loc
                    if not (isinstance(x, str) and (x in _UNION_TAGS or "[" in x)))


def first_error(e: ValidationError) -> BadRequest:
    """The most specific error (deepest field); a union's type errors at one
    field are joined ("a valid boolean; a valid string; ...")."""
    errors = [(_field(err["loc"]) or "body", err["msg"]) for err in e.errors()]
    depth = max(f.count(".") for f, _ in errors)
    field = next(f for f, _ in errors if f.count(".") == depth)
    msgs = list(dict.fromkeys(m for f, m in errors if f == field))
    return BadRequest(field, "; ".join(msgs))


def parse_defaults(raw: str | None) -> dict:
    """``CONSENSUS_SPEC_SC_DEFAULTS`` -> the option fields it sets ({} when
    unset); ValueError naming what is wrong (the server refuses to start)."""
    if not raw:
        return {}
    try:
        fields = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"CONSENSUS_SPEC_SC_DEFAULTS is not JSON: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError("CONSENSUS_SPEC_SC_DEFAULTS must be a JSON object of "
                         f"{', '.join(OPTION_FIELDS)}")
    try:
        resolve_options(RunOptionsIn.model_validate(fields), Limits())
    except ValidationError as e:
        raise ValueError(f"CONSENSUS_SPEC_SC_DEFAULTS: {first_error(e)}") from None
    except BadRequest as e:
        raise ValueError(f"CONSENSUS_SPEC_SC_DEFAULTS: {e}") from None
    return fields


def resolve_options(opts: RunOptionsIn, limits: Limits) -> RunOptions:
    """The option fields -> :class:`RunOptions`; BadRequest naming the field."""
    early = opts.early_stop
    try:
        stop_rule = StopRule(**early.model_dump()) if isinstance(early, StopRuleIn) \
            else resolve_stop_rule(early)
    except ValueError as e:
        raise BadRequest("early_stop", str(e)) from None
    try:
        if opts.schedule is None:
            schedule = None
        elif isinstance(opts.schedule, str):
            schedule = Schedule.parse(opts.schedule)
        else:
            schedule = Schedule(waves=tuple(opts.schedule.waves), check=opts.schedule.check,
                                fill_idle=opts.schedule.fill_idle)
    except ValueError as e:
        raise BadRequest("schedule", str(e)) from None
    auto = schedule is None and stop_rule is not None
    schedule = dataclasses.replace(resolve_schedule(schedule, stop_rule), capacity=limits.max_inflight)
    pattern = opts.answer_pattern
    try:
        if pattern is None:
            extract = extract_final_answer
        elif isinstance(pattern, str):
            extract = AnswerPattern(pattern)
        else:
            extract = AnswerPattern(pattern.pattern, pattern.select)
    except ValueError as e:
        raise BadRequest("answer_pattern", str(e)) from None
    voting = Voting(weighted=opts.voting.weighted, weight_method=opts.voting.weight_method,
                    confidence_keep=opts.voting.confidence_keep,
                    confidence_window=opts.voting.confidence_window,
                    timeout_s=opts.voting.timeout_s, extract=extract)
    try:
        check_voting(stop_rule, voting)
    except ValueError as e:
        raise BadRequest("voting.weighted", str(e)) from None
    return RunOptions(stop_rule, schedule, voting, opts.return_paths, opts.choices, auto)


def split_options(body: dict, defaults: dict) -> tuple[dict, RunOptionsIn]:
    """(the body without the option fields, the options with the server's
    defaults under the request's own); BadRequest naming a bad field."""
    rest = {k: v for k, v in body.items() if k not in OPTION_FIELDS}
    mine = {**defaults, **{k: body[k] for k in OPTION_FIELDS if k in body}}
    try:
        return rest, RunOptionsIn.model_validate(mine)
    except ValidationError as e:
        raise first_error(e) from None

