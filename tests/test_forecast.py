"""The forecast of running paths, an experiment in evals
(evals/adaptive/forecast_model.py): the model's fit, the flip with running
paths, the vote on a planner's running paths, and the waves replay that
takes it; and the library, which it left, refusing the option with a clear
error."""

from __future__ import annotations

import json

import pytest

from consensus_spec.sampling.answer_prior import AnswerPrior
from consensus_spec.sampling.options import OptionError, parse_stop_rule
from consensus_spec.sampling.self_consistency import Schedule, StopRule
from consensus_spec.sampling.waves import PathPlanner
from consensus_spec.voting.answers import answers_equal, extract_answer
from evals.adaptive.forecast_model import (PROGRESS_BANDS, STATES, ForecastModel, InFlightCheck, evidence,
                                           flip_with_running, vote_running)
from tests.evals_cli import STEP_COSTS, TRACES, ok, read_json, run_evals

PRIOR = AnswerPrior.default()


def sure(log_ratio: float = 4.0) -> ForecastModel:
    """A model that trusts a path showing the leader's answer past half-way."""
    rows = [(0.0, 0.0, 0.0)] + [(log_ratio, -log_ratio, 0.0)] * len(PROGRESS_BANDS)
    return ForecastModel(tuple(rows))


def test_flip_without_running_paths_is_the_rules_own():
    for shape in [(2, 0, 0), (3, 1, 0), (2, 1, 1)]:
        assert flip_with_running(PRIOR, *shape, [], 5) == pytest.approx(PRIOR.flip_probability(*shape, 5))


def test_flip_falls_as_running_paths_look_like_the_leader():
    flips = [flip_with_running(PRIOR, 3, 0, 0, [q, q], 3) for q in (0.0, 0.5, 0.9, 1.0)]
    assert flips == sorted(flips, reverse=True) and flips[0] > flips[-1]
    # both running paths certain for the leader: as if they had finished for it
    assert flips[-1] == pytest.approx(PRIOR.flip_probability(5, 0, 0, 3))
    # a running path for the runner-up that would draw level counts as a flip
    assert flip_with_running(PRIOR, 1, 0, 0, [0.0], 0) == 1.0


def test_p_leader_is_the_votes_own_chance_without_evidence():
    model = sure()
    assert model.p_leader(0.8, None, "leader") == 0.8
    assert model.p_leader(0.8, 0.2, "leader") == pytest.approx(0.8)  # below the first band: not read
    assert model.p_leader(0.8, 0.95, "leader") > 0.99 > 0.2 > model.p_leader(0.8, 0.95, "other")


def test_fit_reads_evidence_from_paths_and_round_trips():
    # leader paths show the leader's answer at 0.9; the others show another
    paths = [(True, [(0.5, "none"), (0.9, "leader")])] * 40 + [(False, [(0.5, "none"), (0.9, "other")])] * 10
    model = ForecastModel.fit(paths, fitted_on="toy")
    band = model.band(0.9)
    assert model.log_ratio[0] == (0.0, 0.0, 0.0)
    assert model.log_ratio[band][STATES.index("leader")] > 2
    assert model.log_ratio[band][STATES.index("other")] < -2
    assert model.log_ratio[model.band(0.5)][STATES.index("none")] == pytest.approx(0.0, abs=0.05)
    assert ForecastModel.from_json(json.loads(json.dumps(model.to_json()))) == model
    with pytest.raises(ValueError, match="paths that end on the leader and paths that do not"):
        ForecastModel.fit([(True, [])])
    with pytest.raises(ValueError, match="rows"):
        ForecastModel(((0.0, 0.0, 0.0),))
    saved = ForecastModel.default()  # evals/adaptive/forecast.json
    assert saved.bands == PROGRESS_BANDS and saved.fitted_on


def test_evidence_states():
    same = answers_equal
    assert evidence("so 12 + 3 = 15, then", "15", extract_answer, same) == "leader"
    assert evidence("so 12 + 3 = 14, then", "15", extract_answer, same) == "other"
    assert evidence("let us think", "15", extract_answer, same) == "none"


def test_planner_votes_on_the_started_prefix_and_aborts_running_paths():
    seen = []

    def check(paths, answers, running, unstarted):
        seen.append((paths, answers, running, unstarted))
        return len(paths) >= 1

    planner = PathPlanner(1, 8, Schedule(waves=(4,), capacity=8, fill_idle=False), lambda p, a, r: False)
    assert planner.admit() == [(0, k) for k in range(4)]
    planner.on_finish(0, 2, "5")  # path 2 finished first: the started prefix is 0..3
    submit, abort = vote_running(planner, 0, check)
    assert seen == [([2], ["5"], [0, 1, 3], 4)]
    assert submit == [] and abort == [(0, 0), (0, 1), (0, 3)]
    assert planner.done(0) and 0 in planner.stopped
    assert vote_running(planner, 0, check) == ([], [])  # stopped: nothing more


def test_in_flight_check_stops_on_paths_that_show_the_leader():
    rule = StopRule()
    check = InFlightCheck(rule, PRIOR, sure())
    answers, lengths = ["15", "15"], [100, 100]
    near_end = [(95, lambda: "so 10 + 5 = 15"), (95, lambda: "and 10 + 5 = 15")]
    assert not PRIOR.flip_probability(2, 0, 0, 6 + 2) <= rule.error  # the rule alone would go on
    assert check(answers, lengths, near_end, 4)
    assert not check(answers, lengths, [(95, lambda: "so 10 + 4 = 14")] * 2, 4)
    early = [(10, lambda: pytest.fail("read a path below the first band"))] * 2
    assert not check(answers, lengths, early, 4)
    with pytest.raises(ValueError, match="bayes"):
        InFlightCheck(StopRule(kind="decided"))


def test_waves_replay_with_and_without_the_forecast(tmp_path):
    out = tmp_path / "w"
    text = ok(run_evals("waves", "--traces", TRACES, "--limit", "8", "--orders", "1", "--rows", "16",
                        "--costs", STEP_COSTS, "--host-time", "none", "--early-stop", "on", "decided",
                        "--forecast", "both", "--forecast-model", "saved", "--stride", "2",
                        "--no-plot", "--out", out))
    rows = read_json(tmp_path / "w.json")["results"]
    with_fc = [r for r in rows if r["early_stop"].endswith("+forecast")]
    assert {r["method"] for r in with_fc} == {"none", "consensus"}
    assert all(r["forecast_checks"] > 0 for r in with_fc)
    assert not any("decided+forecast" in r["early_stop"] for r in rows)  # bayes rules only
    assert "bayes(error=0.002)+forecast" in text


def test_the_library_refuses_the_forecast_it_no_longer_takes():
    """A caller or request that still asks for the forecast is told it is
    gone and where it went, never run without it."""
    for value in ({"kind": "bayes", "forecast": True}, "on+forecast", "bayes:0.01+forecast"):
        with pytest.raises(OptionError, match="evals/adaptive") as e:
            parse_stop_rule(value)
        assert e.value.field == "forecast" and "measured no gain" in str(e.value)
    with pytest.raises(TypeError):
        StopRule(forecast=True)
    from consensus_spec.server.options import BadRequest, Limits, resolve_options, split_options
    from evals.options import UsageError, parse_early_stop

    with pytest.raises(UsageError, match="no \\+forecast suffix"):
        parse_early_stop(["on+forecast"])
    _, opts = split_options({"early_stop": {"kind": "bayes", "forecast": True}}, {})
    with pytest.raises(BadRequest) as e:  # the server's 400
        resolve_options(opts, Limits())
    assert e.value.param == "early_stop.forecast" and "evals/adaptive" in str(e.value)
