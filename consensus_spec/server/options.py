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

from pydantic import BaseModel, ConfigDict, ValidationError

from ..sampling.options import (Voting, check_voting, parse_schedule, parse_stop_rule,
                                parse_voting, resolve_schedule)
from ..sampling.stopping import StopRule
from ..sampling.waves import Schedule
from ..voting.answers import extract_final_answer
from ..voting.patterns import AnswerPattern

__all__ = ["BadRequest", "Limits", "OPTION_FIELDS", "RunOptions", "RunOptionsIn",
           "first_error", "parse_defaults", "resolve_options", "split_options"]

MAX_VOTE_TIMEOUT_S = 10.0  # per math-verify comparison: a client may not hold the server longer
MAX_CONFIDENCE_WINDOW = 4096  # tokens
# fields the server sets itself: a request may not (capacity: Limits.max_inflight; extract: answer_pattern)
SERVER_SET = {"schedule": ("capacity",), "voting": ("extract",)}
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


class AnswerPatternIn(Strict):
    pattern: str
    select: int = 0  # 0: the first match, -1: the last (lm-eval's group_select)


class RunOptionsIn(Strict):
    """The option fields as sent; :func:`resolve_options` reads each with the
    library's one parser (:mod:`consensus_spec.sampling.options`), so an
    object's keys are the dataclass's fields and their defaults its own."""

    # True: the library's default StopRule (StopRule()); a kind
    # name or text like "bayes:0.01"; a margin > 0; an object of StopRule
    # fields; false/null: all n paths (parse_stop_rule).
    early_stop: Union[bool, str, float, dict, None] = True
    # "2", "4,4,rest", "all" (Schedule.parse), or an object of Schedule fields but
    # capacity; default: with early stop the engine's load picks all at once or
    # waves (sampling/load_policy.py); without, all at once.
    schedule: Union[str, dict, None] = None
    # an object of Voting fields but extract (answer_pattern sets it)
    voting: Optional[dict] = None
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


_UNION_TAGS = {"str", "int", "float", "bool", "none", "Message", "AnswerPatternIn"}


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


def _parsed(name: str, parse, value, **given):
    """``parse(value)`` (the library's parser); BadRequest naming the field
    (``early_stop.error``), or the option where its value is not an object."""
    try:
        return parse(value, SERVER_SET.get(name, ()), **given)
    except ValueError as e:
        field = getattr(e, "field", "")
        raise BadRequest(f"{name}.{field}" if field else name, str(e)) from None


def resolve_options(opts: RunOptionsIn, limits: Limits) -> RunOptions:
    """The option fields -> :class:`RunOptions`; BadRequest naming the field."""
    stop_rule = _parsed("early_stop", parse_stop_rule, opts.early_stop)
    schedule = _parsed("schedule", parse_schedule, opts.schedule)
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
    voting = _parsed("voting", parse_voting, opts.voting, extract=extract)
    for field, most in (("timeout_s", MAX_VOTE_TIMEOUT_S), ("confidence_window", MAX_CONFIDENCE_WINDOW)):
        if getattr(voting, field) > most:
            raise BadRequest(f"voting.{field}", f"at most {most} on this server, "
                                                f"got {getattr(voting, field)}")
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

