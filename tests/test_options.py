"""One parser per option type (consensus_spec/sampling/options.py): the
library's arguments, the server's JSON and the evals' ``--early-stop`` read a
StopRule, Schedule or Voting through it, so a field added to the dataclass is
taken by all three with nothing else to change."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from consensus_spec.sampling import options
from consensus_spec.sampling.async_loop import run_paths_async
from consensus_spec.sampling.engine_loop import run_paths
from consensus_spec.sampling.options import (LoopOptions, OptionError, Voting, option_fields,
                                             parse_schedule, parse_stop_rule, parse_voting)
from consensus_spec.sampling.stopping import StopRule
from consensus_spec.sampling.waves import Schedule
from consensus_spec.server.options import (SERVER_SET, BadRequest, Limits, parse_defaults,
                                           resolve_options, split_options)
from evals.options import UsageError, parse_early_stop

# a valid value other than the default, for each field an outside form may set
OTHER = {StopRule: {"kind": "sequential", "error": 0.1, "min_samples": 2, "window": 5, "margin": 4},
         Schedule: {"waves": (4, "rest"), "capacity": 8, "check": "path", "fill_idle": False},
         Voting: {"weighted": True, "weight_method": "softmax", "confidence_keep": 0.5,
                  "confidence_window": 8, "timeout_s": 2.0, "extract": str.strip}}


def _server(**fields):
    _, opts = split_options(fields, {})
    return resolve_options(opts, Limits())


def test_every_outside_form_reads_the_same_rule():
    rule = StopRule(kind="bayes", error=0.01, min_samples=2)
    forms = [rule, {"kind": "bayes", "error": 0.01, "min_samples": 2}, "bayes:error=0.01,min_samples=2",
             " BAYES:0.01,min_samples=2 ", "on:0.01,min_samples=2"]
    assert all(parse_stop_rule(f) == rule for f in forms)
    assert parse_stop_rule(True) == parse_stop_rule("on") == parse_stop_rule("default") == StopRule()
    assert parse_stop_rule("off") is parse_stop_rule(False) is parse_stop_rule(None) is None
    assert parse_stop_rule("window:5") == StopRule(kind="window", window=5)
    assert parse_stop_rule("3") == parse_stop_rule(3) == StopRule(kind="margin", margin=3, min_samples=1)
    assert parse_schedule("4,rest+path-check") == parse_schedule({"waves": [4, "rest"], "check": "path"})
    assert parse_voting(None) == parse_voting({}) == Voting()
    assert parse_voting({"weighted": True}, extract=str.strip) == Voting(weighted=True, extract=str.strip)


@pytest.mark.parametrize("value,field", [
    ({"kind": "sequential", "error": 3}, "error"), ({"alpha": 1}, "alpha"), ({"kind": "x"}, "kind"),
    ({"kind": "bayes", "forecast": True}, "forecast"), ("sometimes", ""), ("decided:3", ""),
    ("-1", ""), ("on+fast", "fast"), ([1], ""),
])
def test_a_bad_stop_rule_names_its_field(value, field):
    with pytest.raises(OptionError) as e:
        parse_stop_rule(value)
    assert e.value.field == field and (field in str(e.value))


def test_each_parser_takes_every_dataclass_field():
    """The object forms' keys are the dataclasses' fields; the server refuses
    only the ones it sets itself, and the CLI's KIND:FIELD=VALUE takes each."""
    for cls in (StopRule, Schedule, Voting):
        assert option_fields(cls) == tuple(f.name for f in dataclasses.fields(cls))
        assert set(OTHER[cls]) == set(option_fields(cls))  # OTHER covers a new field too
    for name, value in OTHER[StopRule].items():
        kind = "sequential"
        want = StopRule(kind=kind, **{name: value} if name != "kind" else {})
        assert parse_stop_rule({"kind": kind, name: value}) == want
        early = _server(early_stop={"kind": kind, name: value}).stop_rule
        assert early == want, name
        text = f"{kind}:{name}={str(value).lower()}"
        assert parse_early_stop([text]) == [want], text
    for cls, option, parse in ((Schedule, "schedule", parse_schedule), (Voting, "voting", parse_voting)):
        for name, value in OTHER[cls].items():
            assert getattr(parse({name: value}), name) == value
            if name in SERVER_SET[option]:
                with pytest.raises(BadRequest) as e:
                    _server(**{option: {name: value}, "early_stop": False})
                assert e.value.param == f"{option}.{name}"
            elif name != "waves":  # JSON has lists, not tuples
                assert getattr(getattr(_server(**{option: {name: value}, "early_stop": False}),
                                       option), name) == value


@dataclasses.dataclass(frozen=True)
class PatientRule(StopRule):
    """StopRule with one field more, as a change to stopping.py would add it."""

    patience: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 0:
            raise ValueError(f"PatientRule.patience must be an int >= 0, got {self.patience!r}")


def test_a_new_field_reaches_the_library_the_server_and_the_cli(monkeypatch):
    monkeypatch.setattr(options, "StopRule", PatientRule)
    want = PatientRule(kind="bayes", error=0.01, patience=2)
    assert parse_stop_rule({"error": 0.01, "patience": 2}) == want  # library
    assert _server(early_stop={"error": 0.01, "patience": 2}).stop_rule == want  # server JSON
    assert parse_defaults('{"early_stop": {"patience": 2}}')  # server defaults
    assert parse_early_stop(["bayes:0.01,patience=2"]) == [want]  # evals' --early-stop
    with pytest.raises(BadRequest) as e:
        _server(early_stop={"patience": -1})
    assert e.value.param == "early_stop.patience" and "patience must be an int" in str(e.value)
    with pytest.raises(UsageError, match="patience must be an int"):
        parse_early_stop(["bayes:patience=x"])


def test_both_loops_take_one_options_object_and_make_one_check():
    """run_paths and run_paths_async read LoopOptions (or its fields as
    keywords) and refuse the same combinations with the same error."""
    engine = SimpleNamespace(has_unfinished_requests=lambda: False)

    async def nothing(*args):
        raise AssertionError("nothing may run")

    loops = {"run_paths": lambda **kw: run_paths(engine, ["q"], lambda p, k: None, 4, **kw),
             "run_paths_async": lambda **kw: asyncio.run(
                 run_paths_async(nothing, nothing, ["q"], lambda p, k: None, 4, **kw))}
    bad = [(dict(options=LoopOptions(stop_rule="decided", delta=True), voting={"weighted": True}),
            "weighted voting needs early_stop off"),
           (dict(stop_rule="sometimes"), "a stop rule is")]
    for name, loop in loops.items():
        for kwargs, match in bad:
            with pytest.raises(ValueError, match=match):
                loop(**kwargs)
        with pytest.raises(TypeError, match=f"{name}\\(\\) got an unexpected keyword argument 'scouts'"):
            loop(scouts=2)
    checked = LoopOptions.of(None, {"stop_rule": "decided", "schedule": "4"}, "run_paths")
    assert checked == LoopOptions(Schedule(waves=(4,)), StopRule(kind="decided"), Voting())
    assert LoopOptions().checked().schedule.all_at_once  # no stop rule: every path at once
