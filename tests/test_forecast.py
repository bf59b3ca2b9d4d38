"""The forecast of running paths (consensus_spec/sampling/forecast.py): the
model's fit, the flip with running paths, the planner's vote on them, and
the engine loop and the waves replay that take it."""

from __future__ import annotations

import json

import pytest

from consensus_spec.sampling.answer_prior import AnswerPrior
from consensus_spec.sampling.forecast import (PROGRESS_BANDS, STATES, ForecastModel, InFlightCheck,
                                              evidence, flip_with_running)
from consensus_spec.sampling.self_consistency import Schedule, StopRule, run_paths
from consensus_spec.sampling.waves import PathPlanner
from consensus_spec.voting.answers import answers_equal, extract_answer
from tests.evals_cli import STEP_COSTS, TRACES, ok, read_json, run_evals
from tests.test_self_consistency import FakeEngine, params_factory

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
    shipped = ForecastModel.default()
    assert shipped.bands == PROGRESS_BANDS and shipped.fitted_on


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
    submit, abort = planner.on_progress(0, check)
    assert seen == [([2], ["5"], [0, 1, 3], 4)]
    assert submit == [] and abort == [(0, 0), (0, 1), (0, 3)]
    assert planner.done(0) and 0 in planner.stopped
    assert planner.on_progress(0, check) == ([], [])  # stopped: nothing more


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


def script_stating(table):
    """Path k of problem p: filler, its answer stated at 80% of the way, more
    filler, then "The answer is X."."""
    def script(prompt, params):
        answer, length = table[params.p][params.k]
        head = int(0.8 * length)
        return ["step "] * head + [f"so it is {answer} "] + ["check "] * (length - head) \
            + [f"The answer is {answer}."]
    return script


def test_run_paths_with_a_forecast_stops_sooner_with_the_same_answer():
    table = [[("5", 60 + 2 * k) for k in range(16)]]
    runs = {}
    for forecast in (False, True):
        engine = FakeEngine(script_stating(table))
        run = run_paths(engine, ["q"], params_factory(delta=True), n=16, delta=True,
                        stop_rule=StopRule(forecast=forecast), forecast_model=sure())
        runs[forecast] = run[0]
        assert (run.forecast is None) == (not forecast)
        assert not engine.has_unfinished_requests()
    plain, ahead = runs[False], runs[True]
    assert plain.answer == ahead.answer == "5" and plain.stopped_early and ahead.stopped_early
    assert ahead.num_tokens < plain.num_tokens
    assert ahead.num_aborted >= 1 and ahead.ended_in_flight >= 1


def test_forecast_needs_bayes_and_running_texts():
    table = [[("5", 5)] * 4]
    with pytest.raises(ValueError, match="True only for kind 'bayes'"):
        StopRule(kind="decided", forecast=True)
    assert StopRule(forecast=True).describe() == "bayes(error=0.002)+forecast"
    with pytest.raises(ValueError, match="DELTA"):
        run_paths(FakeEngine(script_stating(table)), ["q"], params_factory(), n=4,
                  stop_rule=StopRule(forecast=True))
    with pytest.raises(ValueError, match="check"):
        run_paths(FakeEngine(script_stating(table)), ["q"], params_factory(delta=True), n=4, delta=True,
                  stop_rule=StopRule(forecast=True), schedule=Schedule(waves=(2,), check="wave"))


def test_early_stop_flag_takes_a_forecast():
    from evals.options import UsageError, parse_early_stop

    assert parse_early_stop(["on+forecast", "on"]) == [StopRule(forecast=True), StopRule()]
    assert parse_early_stop(["bayes:0.01+forecast"]) == [StopRule(error=0.01, forecast=True)]
    for bad in ("decided+forecast", "on+fast"):
        with pytest.raises(UsageError, match="forecast"):
            parse_early_stop([bad])


def test_waves_replay_with_and_without_the_forecast(tmp_path):
    out = tmp_path / "w"
    text = ok(run_evals("waves", "--traces", TRACES, "--limit", "8", "--orders", "1", "--rows", "16",
                        "--costs", STEP_COSTS, "--host-time", "none", "--early-stop", "on", "decided",
                        "--forecast", "both", "--forecast-model", "shipped", "--stride", "2",
                        "--no-plot", "--out", out))
    rows = read_json(tmp_path / "w.json")["results"]
    with_fc = [r for r in rows if r["early_stop"].endswith("+forecast")]
    assert {r["method"] for r in with_fc} == {"none", "consensus"}
    assert all(r["forecast_checks"] > 0 for r in with_fc)
    assert not any("decided+forecast" in r["early_stop"] for r in rows)  # bayes rules only
    assert "bayes(error=0.002)+forecast" in text


def test_async_loop_stops_sooner_with_a_forecast_as_the_step_loop_does():
    import asyncio

    from consensus_spec.sampling.async_loop import run_paths_async
    from tests.test_async_loop import FakeAsyncEngine

    table = [[("5", 60 + 2 * k) for k in range(16)]]
    runs = {}
    for forecast in (False, True):
        engine = FakeAsyncEngine(script_stating(table))
        runs[forecast] = asyncio.run(run_paths_async(
            engine.generate, engine.abort, ["q"], params_factory(delta=True), 16, delta=True,
            stop_rule=StopRule(forecast=forecast), forecast_model=sure()))
        assert runs[forecast].num_tokens == engine.generated and not engine.running
    assert runs[True][0].answer == runs[False][0].answer == "5"
    assert runs[True].num_tokens < runs[False].num_tokens
    assert runs[True][0].ended_in_flight >= 1
    with pytest.raises(ValueError, match="DELTA"):
        asyncio.run(run_paths_async(FakeAsyncEngine(script_stating(table)).generate, None, ["q"],
                                    params_factory(), 16, stop_rule=StopRule(forecast=True)))


def test_run_ahead_weighs_the_running_paths_forecasts():
    from consensus_spec.sampling.run_ahead import RunAhead

    ahead = RunAhead(StopRule())
    plain = ahead.worth(["5", "5"], [5], 16)
    assert plain == ahead.worth(["5", "5"], [5], 16, [])
    sure, doubt = ahead.worth(["5", "5"], [5], 16, [0.99, 0.99]), ahead.worth(["5", "5"], [5], 16, [0.0, 0.0])
    assert sure < plain < doubt == 1.0  # two runner-up votes to come: the wave is surely needed


def test_planner_hands_run_ahead_the_books_forecasts():
    seen = []

    class Recorder:
        costs = None

        def worth(self, answers, looks, n, running=None):
            seen.append(running)
            return 0.0

        def choose(self, first, spare, rows, following, own):
            return []

    planner = PathPlanner(1, 8, Schedule(waves=(2,), capacity=8), lambda p, a, r: False,
                          run_ahead=Recorder())
    planner.running_forecast = lambda p: [0.9, 0.8]
    planner.admit()
    assert seen and seen[-1] == [0.9, 0.8]


def test_a_failing_forecast_leaves_the_run_to_the_rule(caplog):
    from consensus_spec.sampling.self_consistency import Voting

    table = [[("5", 60 + 2 * k) for k in range(16)]]
    def extract(text):  # the vote's own extraction works; the partial-text one breaks
        if "The answer is" not in text:
            raise RuntimeError("extractor bug")
        return text.rsplit(" ", 1)[-1].rstrip(".")

    engine = FakeEngine(script_stating(table))
    (r,) = run_paths(engine, ["q"], params_factory(delta=True), n=16, delta=True,
                     stop_rule=StopRule(forecast=True), forecast_model=sure(),
                     voting=Voting(extract=extract))
    assert r.answer == "5" and r.stopped_early and not engine.has_unfinished_requests()
    assert "the forecast failed" in caplog.text


def test_forecasts_are_scored_on_the_paths_that_finish_after_them():
    from consensus_spec.sampling.forecast import ForecastScore

    score = ForecastScore()
    score.add(0.9, 0.6, True)
    score.add(0.2, 0.6, False)
    d = score.as_dict()
    assert d["paths"] == 2 and d["log_loss"] < d["log_loss_without"]
    # paths that show a runner-up's answer keep the vote open: they finish, and are scored
    table = [[("5" if k % 3 else "6", 60 + 2 * k) for k in range(16)]]
    run = run_paths(FakeEngine(script_stating(table)), ["q"], params_factory(delta=True), n=16,
                    delta=True, stop_rule=StopRule(forecast=True), forecast_model=sure(),
                    schedule=Schedule(waves=(4,)))
    assert run.forecast["paths"] >= 1
    assert run.forecast["log_loss"] < run.forecast["log_loss_without"]
