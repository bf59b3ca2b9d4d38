"""A self-consistency run's options, parsed and checked in one place: how
paths are voted (:class:`Voting`); one parser per option type from every
outside form, the library's arguments, the server's JSON and the evals'
command lines (:func:`parse_stop_rule`, :func:`parse_schedule`,
:func:`parse_voting`), whose object keys are the dataclass's fields
(:func:`option_fields`), so a new field needs nothing else; and what both
engine loops take and check (:class:`LoopOptions`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..voting.answers import DEFAULT_TIMEOUT_S, extract_answer
from ..voting.confidence import DEFAULT_WINDOW
from ..voting.vote import VoteResult
from .stopping import KINDS, MAIN_FIELD, StopRule
from .waves import ALL_AT_ONCE, Schedule

__all__ = ["OptionError", "Voting", "WEIGHT_METHODS", "LoopOptions", "check_voting",
           "option_fields", "parse_schedule", "parse_stop_rule", "parse_voting", "text_value",
           "resolve_schedule", "vote_is_settled"]

WEIGHT_METHODS = ("exp_mean", "softmax", "confidence")


@dataclass(frozen=True)
class Voting:
    """How a problem's finished paths are voted into one answer.

    ``extract``: text -> answer (None: no answer, the path abstains).
    ``weighted``: weight votes by :func:`~consensus_spec.voting.vote.logprob_weights`
    of mean token logprobs (``weight_method`` ``exp_mean`` or ``softmax``), or
    DeepConf-style (``"confidence"``: only the ``confidence_keep`` share of
    paths with the highest lowest-window confidence vote, weighted by it;
    :func:`~consensus_spec.voting.confidence.confidence_weights`); needs logprobs.
    ``timeout_s``: per math-verify comparison when clustering answers.
    """

    weighted: bool = False
    weight_method: str = "exp_mean"
    confidence_keep: float = 0.9  # "confidence": DeepConf's top share (its paper: 0.1 or 0.9)
    confidence_window: int = DEFAULT_WINDOW  # "confidence": tokens per window
    timeout_s: float = DEFAULT_TIMEOUT_S
    extract: Callable[[str], str | None] = extract_answer

    def __post_init__(self) -> None:
        if not isinstance(self.weighted, bool):
            raise ValueError(f"Voting.weighted must be a bool, got {self.weighted!r}")
        if self.weight_method not in WEIGHT_METHODS:
            raise ValueError(f"Voting.weight_method must be one of {WEIGHT_METHODS}, "
                             f"got {self.weight_method!r}")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool) \
                or not self.timeout_s > 0:
            raise ValueError(f"Voting.timeout_s must be > 0, got {self.timeout_s!r}")
        if not callable(self.extract):
            raise ValueError("Voting.extract must be callable")
        keep, window = self.confidence_keep, self.confidence_window
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0.0 < keep <= 1.0:
            raise ValueError(f"Voting.confidence_keep must be a share in (0, 1], got {keep!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"Voting.confidence_window must be an int >= 1, got {window!r}")

    @property
    def needs_token_logprobs(self) -> bool:
        """Whether the vote reads each token's logprob, not just the path's sum."""
        return self.weighted and self.weight_method == "confidence"


class OptionError(ValueError):
    """A bad option value.  ``field``: the dataclass field it names (an
    object form's key, e.g. ``"error"``), or "" for the value as a whole."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


def option_fields(cls: type) -> tuple[str, ...]:
    """The keys an object form of ``cls`` (StopRule, Schedule, Voting) takes:
    its dataclass fields, in order."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


def _from_object(cls: type, data: Mapping, fixed: tuple[str, ...] = (), given: Mapping = {}):
    """``cls(**given, **data)``: a key of ``data`` that is unknown, or in
    ``fixed`` (the caller sets it, not the data), is an OptionError naming
    it, and so is a value that ``cls`` refuses (its errors begin ``Cls.field``)."""
    known = [name for name in option_fields(cls) if name not in fixed]
    for key in data:
        if key in RETIRED.get(cls.__name__, {}):
            raise OptionError(f"{cls.__name__} has no field {key!r} any more: "
                              f"{RETIRED[cls.__name__][key]}; it takes " + ", ".join(known), str(key))
        if key not in known:
            raise OptionError(f"{cls.__name__} takes no field {key!r} here; it takes "
                              + ", ".join(known), str(key))
    try:
        return cls(**{**given, **data})
    except (ValueError, TypeError) as e:
        named = re.match(rf"{cls.__name__}\.(\w+)", str(e))
        raise OptionError(str(e), named.group(1) if named else "") from None


STOP_RULE_FORMS = ("off, on, a kind, KIND:VALUE, KIND:FIELD=VALUE[,FIELD=VALUE...], a margin > 0, "
                   "or an object of StopRule fields")
# fields an option took once: a request or command line that still sends one is told why it
# is gone, not sent on with it ignored
RETIRED = {"StopRule": {"forecast": "the vote on running paths' forecasts measured no gain "
                                    "(docs/stopping.md) and left the library; it is a replay "
                                    "experiment now (python -m evals waves --forecast both, "
                                    "evals/adaptive/forecast_model.py)"}}
OFF, ON = ("off", "none", "no", "false"), ("on", "true", "yes", "default")


def text_value(text: str) -> Any:
    """A command line's value: JSON where it parses (``0.05``, ``4``, ``true``), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _stop_rule_text(text: str) -> StopRule | None:
    """``KIND[:VALUE | :FIELD=VALUE,...]``, off/on, or a margin."""
    head, *flags = text.strip().lower().split("+")
    if flags:  # StopRule has no bool field left to set so (+forecast was one)
        flag = flags[0].strip()
        why = RETIRED["StopRule"].get(flag)
        raise OptionError(f"a stop rule takes no +{flag} suffix" + (f": {why}" if why else "")
                          + f" (got {text!r}); it is {STOP_RULE_FORMS}", flag)
    kind, _, params = head.partition(":")
    if kind in OFF and not params:
        return None
    kind = StopRule.kind if kind in ON else kind
    if kind not in KINDS:
        try:
            margin = float(head)
        except ValueError:
            margin = math.nan
        if not (margin > 0 and math.isfinite(margin)):
            raise OptionError(f"a stop rule is {STOP_RULE_FORMS} (kinds: {', '.join(KINDS)}), "
                              f"got {text!r}")
        return parse_stop_rule(margin)
    fields: dict[str, Any] = {"kind": kind}
    for part in filter(None, params.split(",")):
        name, eq, value = part.partition("=")
        if not eq:  # KIND:VALUE sets the kind's own parameter
            if kind not in MAIN_FIELD:
                raise OptionError(f"{kind!r} takes no KIND:VALUE (name the field: "
                                  f"{kind}:FIELD=VALUE), got {text!r}")
            name, value = MAIN_FIELD[kind], part
        fields[name.strip()] = text_value(value.strip())
    try:
        return _from_object(StopRule, fields)
    except OptionError as e:
        raise OptionError(f"{e} (in {text!r})", e.field) from None


def parse_stop_rule(value: Any, fixed: tuple[str, ...] = ()) -> StopRule | None:
    """Every outside form of a stop rule -> StopRule, or None (off).

    None/False: off.  True: the default :class:`StopRule` (``bayes``, error
    0.002).  A StopRule: itself.  A number m > 0 (the old margin API):
    ``StopRule(kind="margin", margin=ceil(m), min_samples=1)``.  A dict (the
    server's JSON): StopRule fields (:func:`option_fields`).  Text (the
    library's kind names, the evals' ``--early-stop``): ``off``/``on``, a
    kind (``"decided"``: its default parameters), ``KIND:VALUE`` (the kind's
    own parameter, :data:`~consensus_spec.sampling.stopping.MAIN_FIELD`:
    ``bayes:0.01``, ``window:5``), ``KIND:FIELD=VALUE,...``
    (``bayes:error=0.01,min_samples=2``), or a margin (``"3"``).  A bad
    value is an :class:`OptionError`, naming the field where the value is an
    object (a field the rule no longer takes, :data:`RETIRED`, says why).
    """
    if value is None or value is False:
        return None
    if value is True:
        return StopRule()
    if isinstance(value, StopRule):
        return value
    if isinstance(value, Mapping):
        return _from_object(StopRule, value, fixed)
    if isinstance(value, str):
        return _stop_rule_text(value)
    if isinstance(value, (int, float)) and value > 0 and math.isfinite(value):
        return StopRule(kind="margin", margin=math.ceil(value), min_samples=1)
    raise OptionError(f"a stop rule is {STOP_RULE_FORMS}, got {value!r}")


def parse_schedule(value: Any, fixed: tuple[str, ...] = ()) -> Schedule | None:
    """Every outside form of a schedule -> Schedule, or None (the default,
    :func:`resolve_schedule`).  Text: :meth:`Schedule.parse` (``"4,4,rest"``,
    ``"all"``, ``"2+no-fill"``); a dict: Schedule fields (waves as a list);
    a Schedule: itself.  ``fixed``: fields the caller sets, refused as keys."""
    if value is None or isinstance(value, Schedule):
        return value
    if isinstance(value, Mapping):
        return _from_object(Schedule, value, fixed)
    if isinstance(value, str):
        return Schedule.parse(value)
    raise OptionError(f"a schedule is text like '4,4,rest' or 'all', or an object of Schedule "
                      f"fields, got {value!r}")


def parse_voting(value: Any, fixed: tuple[str, ...] = (), **given) -> Voting:
    """Every outside form of a vote -> Voting: None (the plain majority),
    a dict of Voting fields, or a Voting.  ``given``: fields the caller sets
    (the server's ``extract``), under the dict's."""
    if isinstance(value, Voting):
        return dataclasses.replace(value, **given) if given else value
    if not isinstance(value, (Mapping, type(None))):
        raise OptionError(f"voting is an object of Voting fields, got {value!r}")
    return _from_object(Voting, value or {}, fixed, given)


def resolve_schedule(schedule: Any, stop_rule: StopRule | None) -> Schedule:
    """Any form :func:`parse_schedule` takes -> Schedule; None -> the default
    waves when stopping, else all paths at once (without a stop rule waves
    only add latency)."""
    schedule = parse_schedule(schedule)
    if schedule is None:
        return Schedule() if stop_rule is not None else ALL_AT_ONCE
    return schedule


def vote_is_settled(vote: VoteResult, remaining: int, max_weight: float = 1.0) -> bool:
    """The exact rule on a finished vote: the leader's lead exceeds
    ``remaining * max_weight``, so no outcome of the remaining paths can
    change the winner.  Kept as the reference for ``StopRule(kind="decided")``
    (tests/test_stopping.py cross-checks the two); the engine loop uses
    :func:`consensus_spec.sampling.stopping.should_stop`."""
    return vote.winner is not None and vote.margin > remaining * max_weight


def check_voting(stop_rule: StopRule | None, voting: Voting) -> None:
    """A weighted vote takes no stop rule (ValueError): stop rules count
    unweighted votes.  The library's loops and the server both ask here."""
    if stop_rule is not None and voting.weighted:
        raise ValueError("stop rules count unweighted votes: weighted voting needs early_stop off")


@dataclass(frozen=True)
class LoopOptions:
    """What both engine loops take beyond the engine, the prompts and the
    sampling params (:func:`~consensus_spec.sampling.engine_loop.run_paths`,
    :func:`~consensus_spec.sampling.async_loop.run_paths_async`): each
    accepts one of these or its fields as keywords.

    ``schedule`` (any form :func:`parse_schedule` takes; None: the default,
    :func:`resolve_schedule`) sets waves and capacity; ``stop_rule`` (any
    form :func:`parse_stop_rule` takes; None: never stop early) is asked with
    the unweighted answers; ``voting`` (:func:`parse_voting`; None: the
    plain majority); ``max_tokens`` per path; ``delta``: the sampling params
    ask for DELTA outputs (needed to count the tokens of aborted paths; see
    ``Schedule.may_abort``); ``prior``: the stop rule's
    :class:`~consensus_spec.sampling.answer_prior.AnswerPrior` (see
    :class:`~consensus_spec.sampling.path_book.PathBook`).
    """

    schedule: Any = None
    stop_rule: Any = None
    voting: Any = None
    max_tokens: int = 1024
    delta: bool = False
    prior: Any = None

    @classmethod
    def of(cls, options: "LoopOptions | None", fields: dict, caller: str) -> "LoopOptions":
        """``options`` with ``fields`` (a loop's keywords) over it, parsed and
        checked (:meth:`checked`); an unknown keyword is a TypeError, as a
        function's would be."""
        unknown = sorted(set(fields) - set(option_fields(cls)))
        if unknown:
            raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
        return dataclasses.replace(options or cls(), **fields).checked()

    def checked(self) -> "LoopOptions":
        """The options parsed, with their defaults, and the check that
        combines them: a weighted vote takes no stop rule."""
        stop_rule = parse_stop_rule(self.stop_rule)
        schedule, voting = resolve_schedule(self.schedule, stop_rule), parse_voting(self.voting)
        check_voting(stop_rule, voting)
        return dataclasses.replace(self, schedule=schedule, stop_rule=stop_rule, voting=voting)
