"""The schedule a shared engine's load picks (consensus_spec/sampling/load_policy.py),
and the vote that ends an all-at-once problem's paths once no remaining path
could change it, whichever paths finished first."""

import pytest

from consensus_spec.sampling.load_policy import (ALL, REQUESTED, WAVES, EngineLoad,
                                                 choose_schedule, requested)
from consensus_spec.sampling.waves import PathPlanner, Schedule

WAVES_OF_2 = Schedule(capacity=64)


def test_every_path_at_once_while_every_problem_in_flight_fits_in_the_batch():
    load = EngineLoad(max_rows=128, rows_busy=112, problem_rows=7 * 16, problems_in_flight=7)
    schedule, choice = choose_schedule(load, 1, 16, WAVES_OF_2)
    assert choice.mode == ALL and schedule.all_at_once and schedule.capacity == 64
    assert choice.schedule == "all" and choice.rows_wanted == 128
    assert "7 other problems in flight" in choice.reason
    # one more problem in flight: n at once would queue, so it waves
    load = EngineLoad(max_rows=128, rows_busy=128, problem_rows=8 * 16, problems_in_flight=8)
    schedule, choice = choose_schedule(load, 1, 16, WAVES_OF_2)
    assert choice.mode == WAVES and schedule.waves == (4, 4, "rest")  # 9 x 4 fit in 64 rows
    assert choice.rows_wanted == 144 and choice.as_dict()["max_rows"] == 128


def test_few_waves_while_each_problems_wave_of_4_fits_in_half_the_batch():
    # 16 problems in flight (this one too) x 4 = 64 of 128 rows: waves of 4, 4, rest
    load = EngineLoad(max_rows=128, rows_busy=100, problem_rows=15 * 16, problems_in_flight=15)
    schedule, choice = choose_schedule(load, 1, 16, WAVES_OF_2)
    assert choice.mode == WAVES and schedule.waves == (4, 4, "rest") and choice.schedule == "4,4,rest"
    assert schedule.capacity == 64 and "waves of 4 for 16 problems" in choice.reason
    assert schedule.sizes(16) == [4, 4, 8]
    # 17: 68 rows would be more than half the batch, so waves of 2
    load = EngineLoad(max_rows=128, rows_busy=100, problem_rows=16 * 16, problems_in_flight=16)
    assert choose_schedule(load, 1, 16, WAVES_OF_2)[0] == WAVES_OF_2


def test_a_problem_counts_its_n_paths_however_few_it_runs_now():
    # 8 waving problems hold 2 rows each: 112 rows sit idle, but all 8 at once would want 128
    load = EngineLoad(max_rows=128, rows_busy=16, problem_rows=8 * 16, problems_in_flight=8)
    assert choose_schedule(load, 1, 16, WAVES_OF_2)[1].mode == WAVES


def test_other_requests_rows_and_the_queue_count_and_a_list_counts_each_problem():
    alone = EngineLoad(max_rows=32)
    assert choose_schedule(alone, 2, 16, WAVES_OF_2)[1].mode == ALL
    assert choose_schedule(alone, 3, 16, WAVES_OF_2)[1].mode == WAVES  # a list of 3 problems
    busy = EngineLoad(max_rows=32, rows_busy=20, waiting=4, other_rows=24, row_cost=0.61234)
    _, choice = choose_schedule(busy, 1, 16, WAVES_OF_2)
    assert choice.mode == WAVES and "24 rows of other requests" in choice.reason
    assert choice.as_dict()["row_cost"] == 0.612 and choice.waiting == 4
    assert choose_schedule(busy, 1, 8, WAVES_OF_2)[1].mode == ALL  # 24 + 8 fit


def test_a_named_schedule_is_reported_as_requested_and_bad_counts_are_refused():
    choice = requested(Schedule(waves=(4,)))
    assert choice.mode == REQUESTED and choice.schedule == "4"
    choice = requested(Schedule(waves=("rest",)), early_stop=False)
    assert choice.mode == ALL and "early stop off" in choice.reason
    with pytest.raises(ValueError):
        choose_schedule(EngineLoad(max_rows=8), 0, 16, WAVES_OF_2)


def test_all_at_once_ends_the_paths_once_no_remaining_path_could_change_the_vote():
    """Paths finishing out of path order: the vote in path order waits for
    path 0, but 9 of 16 agreeing is decided whichever paths they are."""
    looks = []
    plan = PathPlanner(1, 16, Schedule(waves=("rest",), capacity=16),
                       stop_check=lambda p, a, r: looks.append(len(a)) or False)
    plan.decided_check = lambda p, a, r: a.count("7") - max(
        (a.count(x) for x in set(a) - {"7"}), default=0) > r
    assert len(plan.admit()) == 16
    for k in range(1, 9):  # paths 1..8 agree; path 0 still runs
        assert plan.on_finish(0, k, "7") == ([], [])
    assert looks == [] and not plan.done(0)  # no look in path order without path 0
    _, abort = plan.on_finish(0, 9, "7")  # 9 for "7", 7 unfinished: decided
    assert plan.done(0) and sorted(k for _, k in abort) == [0] + list(range(10, 16))


def test_the_decided_vote_is_exact_and_reported(monkeypatch):
    """Through PathBook: the stop is the full vote's answer, said so in the
    result; a peer's rule (published as its authors' code) has no such stop."""
    from types import SimpleNamespace

    from consensus_spec.sampling.options import Voting
    from consensus_spec.sampling.path_book import PathBook
    from consensus_spec.sampling.stopping import StopRule
    from consensus_spec.server.protocol import stop_reason

    def finish_out_of_order(rule):
        book = PathBook(1, 8, Schedule(waves=("rest",), capacity=8), rule, Voting(), 64)
        book.admit()
        for k in range(7, 2, -1):  # paths 7..3 finish first, all "5"
            book.update((0, k), SimpleNamespace(text="The answer is 5.", token_ids=[1] * 10,
                                                cumulative_logprob=None, finish_reason="stop"),
                        delta=False)
            book.finish((0, k))
        return book

    book = finish_out_of_order(StopRule())
    result = book.result(0)
    assert result.stopped_early and result.decided and result.stopped_after == 5
    assert result.answer == "5" and result.num_aborted == 3  # paths 0-2 ended in flight
    assert "decided after 5 of 8 paths" in stop_reason(result, 8, StopRule())
    assert not finish_out_of_order(StopRule(kind="adaptive")).done(0)


def test_the_server_counts_problems_in_flight_and_reports_each_choice():
    """``run_request`` chooses by the problems the server has in flight and
    the engine's rows beyond them, counts its own until answered, and tells
    the route (``on_schedule``) and the state route what it chose."""
    import asyncio
    from argparse import Namespace
    from types import SimpleNamespace

    from consensus_spec.server import runs
    from consensus_spec.server.options import Limits, RunOptionsIn, resolve_options
    from consensus_spec.server.state import ServerState
    from consensus_spec.server.step_costs import EngineStepCosts

    class Engine:
        model_config = SimpleNamespace(max_model_len=512, get_diff_sampling_param=dict)

        def __init__(self):
            self.sent = 0

        async def generate(self, prompt, params, rid, priority=0):
            self.sent += 1
            await asyncio.sleep(0)
            yield SimpleNamespace(request_id=rid, finished=True, outputs=[SimpleNamespace(
                text="The answer is 4.", token_ids=[7], cumulative_logprob=-1.0, logprobs=None,
                finish_reason="stop", stop_reason=None)])

        async def abort(self, rids):
            pass

    costs = EngineStepCosts("cpu_embedded")
    costs.measured = True
    st = ServerState(Engine(), Namespace(), Limits(max_inflight=64), 64, costs=costs)
    auto = resolve_options(RunOptionsIn(), Limits(max_inflight=64))
    assert auto.schedule_auto and not resolve_options(RunOptionsIn(schedule="4"), Limits()).schedule_auto
    prompts = [{"prompt_token_ids": [1, 2, 3]}]
    make = lambda p, k: SimpleNamespace(n=1, logprobs=None, seed=None)  # noqa: E731
    request = SimpleNamespace(headers={})

    def run(opts, n=16):
        seen = []
        result = asyncio.run(runs.run_request(st, request, "r", prompts, make, n, opts, 16,
                                              on_schedule=seen.append))
        assert "r" not in st.problems and st.runs == {}  # nothing held once answered
        return seen[0], result

    choice, result = run(auto)
    assert choice.mode == ALL and result.config["schedule"] == "all"
    assert result[0].stopped_early  # 16 paths sent at once, the vote settled before all ended
    st.problems["other"] = [3, 16]  # 3 problems in flight elsewhere: 64 rows wanted with ours
    assert run(auto)[0].mode == ALL
    st.problems["other"] = [4, 16]
    choice, result = run(auto)
    assert choice.mode == WAVES and result.config["schedule"] == "4,4,rest"  # 5 x 4 fit in 32 rows
    costs.record(0, running=20, drafted=0, prefill=False, waiting=3)  # 23 rows, none ours
    st.problems.pop("other")
    choice, _ = run(auto)
    assert choice.mode == ALL and choice.rows_busy == 20 and choice.waiting == 3
    assert choice.rows_wanted == 23 + 16
    assert run(auto, n=48)[0].mode == WAVES  # 23 + 48 > 64
    assert run(resolve_options(RunOptionsIn(schedule="4"), Limits()))[0].mode == REQUESTED
    state = st.snapshot()["schedule"]
    assert state["requests"] == {ALL: 3, WAVES: 2, REQUESTED: 1}
    assert state["last"]["mode"] == REQUESTED and state["problems_in_flight"] == 0
    # requests that arrived together: each parsed one counts for those choosing before it
    st.arrived("a", 2, 16)
    st.arrived("r", 1, 16)  # the run's own arrival is not counted against itself
    assert st.load().problems_in_flight == 3 and st.snapshot()["schedule"]["requests_arriving"] == 2
    choice, _ = run(auto)
    assert choice.problems_in_flight == 2 and choice.rows_wanted == 23 + 48
    assert "r" not in st.pending and st.late(1e9) and not st.late(0.0)
