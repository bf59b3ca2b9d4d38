"""The pure wave planner (consensus_spec.sampling.waves): schedule validation, wave
order, pipelining under capacity, stop checks and aborts, event by event."""

from __future__ import annotations

import random

import pytest

from consensus_spec.sampling.waves import ALL_AT_ONCE, DEFAULT_WAVES, REST, PathPlanner, Schedule

# ---------------------------------------------------------------------------
# Schedule
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("waves,n,sizes", [
    ((1, 2, 4, REST), 16, [1, 2, 4, 9]),
    ((1, 2, 4, REST), 3, [1, 2]),
    ((1, 2, 4, REST), 7, [1, 2, 4]),
    ((4,), 10, [4, 4, 2]),
    ((2, 3), 10, [2, 3, 3, 2]),
    ((REST,), 5, [5]),
    ((4, 4, REST), 1, [1]),
])
def test_wave_sizes(waves, n, sizes):
    assert Schedule(waves=waves).sizes(n) == sizes
    assert sum(sizes) == n


@pytest.mark.parametrize("kwargs,match", [
    (dict(waves=()), "empty"),
    (dict(waves=(REST, 4)), "last"),
    (dict(waves=(0, REST)), "ints >= 1"),
    (dict(waves=(-2,)), "ints >= 1"),
    (dict(waves=(True, REST)), "ints >= 1"),
    (dict(waves=("4", REST)), "ints >= 1"),
    (dict(waves=(2.5,)), "ints >= 1"),
    (dict(waves=4), "sequence"),
    (dict(waves="rest"), "sequence"),
    (dict(capacity=0), "capacity"),
    (dict(capacity=True), "capacity"),
    (dict(capacity=2.0), "capacity"),
    (dict(check="step"), "check"),
])
def test_schedule_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Schedule(**kwargs)


def test_schedule_parse_describe_and_defaults():
    assert Schedule.parse("1,2,4,rest") == Schedule(waves=(1, 2, 4, REST))
    assert Schedule.parse("4 4 rest", capacity=8).capacity == 8
    assert Schedule.parse("all") == ALL_AT_ONCE and ALL_AT_ONCE.all_at_once
    assert Schedule(waves=[4, 4, REST]).waves == (4, 4, REST)  # lists become tuples: hashable
    assert Schedule().waves == DEFAULT_WAVES and Schedule().check == "index"
    assert Schedule.parse("4,4,rest").describe() == "4,4,rest"
    assert Schedule(waves=(REST,), check="path").describe() == "all+path-check"
    assert Schedule.parse("2+wave-check") == Schedule(check="wave")
    for bad in ("", "x", "4,rest,4", "0,rest"):
        with pytest.raises(ValueError):
            Schedule.parse(bad)
    with pytest.raises(Exception):  # frozen
        Schedule().capacity = 3  # type: ignore[misc]


@pytest.mark.parametrize("kwargs", [dict(n=0), dict(n=True), dict(n=2.0)])
def test_planner_rejects_bad_n(kwargs):
    with pytest.raises(ValueError):
        PathPlanner(1, **kwargs)


# ---------------------------------------------------------------------------
# Ordering and pipelining
# ---------------------------------------------------------------------------


def test_waves_open_one_after_another_and_fill_capacity():
    plan = PathPlanner(3, n=8, schedule=Schedule(waves=(2, 2, REST), capacity=4))
    assert plan.admit() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert plan.admit() == []  # full
    # a path of problem 0 finishes: its wave is not done, so problem 2 gets the row
    assert plan.on_finish(0, 0, "a") == ([(2, 0)], [])
    # problem 0's first wave is done: its second wave opens, one row is free;
    # the older problem goes first, ahead of problem 2's unsent first-wave path
    assert plan.on_finish(0, 1, "a") == ([(0, 2)], [])
    assert plan.on_finish(1, 0, "b") == ([(0, 3)], [])
    assert plan.on_finish(1, 1, "b") == ([(1, 2)], [])  # problem 1's wave 2 before problem 2's rest
    assert plan.on_finish(2, 0, "c") == ([(1, 3)], [])
    assert plan.on_finish(0, 2, "a") == ([(2, 1)], [])
    # problem 0's second wave done: the rest (4 paths) is opened and sent as rows free up
    assert plan.on_finish(0, 3, "a") == ([(0, 4)], [])
    assert plan.num_inflight == 4 and plan.waves_started(0) == 3 and plan.waves_started(2) == 1


def test_stop_from_outside_ends_a_problem_as_a_settled_vote_does():
    plan = PathPlanner(2, n=4, schedule=Schedule(waves=(2, REST), capacity=3))
    assert plan.admit() == [(0, 0), (0, 1), (1, 0)]
    # problem 0 ends now: its running paths are aborted and its two rows go to
    # problem 1 (the rest of its first wave, then its next wave into the idle row)
    assert plan.stop(0) == ([(1, 1), (1, 2)], [(0, 0), (0, 1)])
    assert 0 in plan.stopped and plan.num_inflight == 3 and plan.num_unsent(0) == 2
    assert plan.stop(0) == ([], [])  # already stopped: nothing more
    assert plan.stop(5) == ([], [])  # not a problem of this run


def test_progress_reads_a_running_problems_paths_until_it_is_done():
    plan = PathPlanner(2, n=4, schedule=Schedule(waves=(3, REST), capacity=3))
    assert plan.progress(0) is None  # not admitted
    assert plan.admit() == [(0, 0), (0, 1), (0, 2)]
    assert plan.on_finish(0, 1, "7") == ([(1, 0)], [])  # the freed row goes to problem 1
    now = plan.progress(0)
    assert (now.finished, now.answers, now.running, now.not_started) == ([1], ["7"], [0, 2], 1)
    plan.stop(0)
    assert plan.progress(0) is None  # stopped: nothing running


def test_unbounded_capacity_sends_every_opened_wave_at_once():
    plan = PathPlanner(2, n=3)  # default schedule: all at once
    assert plan.admit() == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    plan = PathPlanner(2, n=4, schedule=Schedule(waves=(1, REST)))
    assert plan.admit() == [(0, 0), (1, 0)]
    assert plan.on_finish(1, 0, "x") == ([(1, 1), (1, 2), (1, 3)], [])


def simulate(plan: PathPlanner, lengths, answers=None, capacity=None, admitted=None):
    """Drive ``plan`` like an engine: each in-flight path takes lengths[p][k]
    ticks; returns (in-flight count per tick, finish log, abort log)."""
    running: dict[tuple[int, int], int] = {}
    fill, fins, aborted = [], [], []

    def submit(paths):
        for p, k in paths:
            assert (p, k) not in running
            running[(p, k)] = lengths[p][k]

    submit(plan.admit())
    while running:
        fill.append(len(running))
        if admitted is not None:
            admitted.append(plan.next_problem)
        assert len(running) == plan.num_inflight
        assert capacity is None or len(running) <= capacity
        for key in list(running):
            running[key] -= 1
        for key in sorted(k for k, left in running.items() if left == 0):
            if key not in running:
                continue
            del running[key]
            fins.append(key)
            to_submit, to_abort = plan.on_finish(*key, answers[key[0]][key[1]] if answers else "x")
            for a in to_abort:
                running.pop(a)
                aborted.append(a)
            submit(to_submit)
    return fill, fins, aborted


def test_pipelining_keeps_the_batch_full_until_the_tail():
    rng = random.Random(0)
    num, n, cap = 40, 16, 32
    lengths = [[rng.randint(5, 40) for _ in range(n)] for _ in range(num)]
    plan = PathPlanner(num, n, Schedule(waves=(1, 2, 4, REST), capacity=cap))
    admitted = []  # problems admitted before each tick
    fill, fins, _ = simulate(plan, lengths, capacity=cap, admitted=admitted)
    admitted_all = admitted.index(num)  # first tick after the last admission
    assert plan.all_done and len(fins) == num * n and plan.num_inflight == 0
    # the batch is full on every tick while problems wait for admission: only
    # the tail (the last problems' remaining waves) runs below capacity
    first_short = next(i for i, f in enumerate(fill) if f < cap)
    assert first_short >= admitted_all
    assert sum(fill[:first_short]) == cap * first_short
    assert sum(fill) / len(fill) > 0.75 * cap


def test_each_wave_waits_for_the_whole_previous_wave():
    rng = random.Random(1)
    lengths = [[rng.randint(1, 9) for _ in range(8)] for _ in range(6)]
    schedule = Schedule(waves=(1, 3, REST), capacity=5, fill_idle=False)
    plan = PathPlanner(6, 8, schedule)
    sent_at: dict[tuple[int, int], int] = {}
    finished_at: dict[tuple[int, int], int] = {}
    events = 0
    orig = plan.on_finish

    def on_finish(p, k, a):
        nonlocal events
        events += 1
        finished_at[(p, k)] = events
        out = orig(p, k, a)
        for key in out[0]:
            sent_at[key] = events
        return out

    plan.on_finish = on_finish  # type: ignore[method-assign]
    for key in plan.admit():
        sent_at[key] = 0
    # re-run the simulation with the recording planner
    running = {key: lengths[key[0]][key[1]] for key in sent_at}
    while running:
        for key in list(running):
            running[key] -= 1
        for key in sorted(k for k, left in running.items() if left == 0):
            del running[key]
            for new in plan.on_finish(*key, "x")[0]:
                running[new] = lengths[new[0]][new[1]]
    bounds = [0, 1, 4, 8]
    for p in range(6):
        for w in (1, 2):
            first_of_next = min(sent_at[(p, k)] for k in range(bounds[w], bounds[w + 1]))
            last_of_prev = max(finished_at[(p, k)] for k in range(bounds[w - 1], bounds[w]))
            assert first_of_next >= last_of_prev


# ---------------------------------------------------------------------------
# Stop checks and aborts
# ---------------------------------------------------------------------------


def test_stop_is_checked_only_at_wave_boundaries():
    calls = []

    def check(p, answers, remaining):
        calls.append((p, len(answers), remaining))
        return False

    plan = PathPlanner(2, n=10, schedule=Schedule(waves=(2, 3, REST), check="wave"), stop_check=check)
    lengths = [[1 + (k * 7) % 5 for k in range(10)] for _ in range(2)]
    simulate(plan, lengths)
    for p in range(2):  # after 2 and 5 finished paths; never after the last wave
        assert [(c[1], c[2]) for c in calls if c[0] == p] == [(2, 8), (5, 5)]


def test_stop_at_a_wave_boundary_opens_no_more_waves():
    def check(p, answers, remaining):
        return p == 0 and len(answers) >= 3 and len(set(answers)) == 1

    plan = PathPlanner(2, n=8, schedule=Schedule(waves=(3, REST), capacity=4), stop_check=check)
    answers = [["a"] * 8, ["a", "b", "a"] + ["a"] * 5]
    fill, fins, aborted = simulate(plan, [[2] * 8, [2] * 8], answers, capacity=4)
    assert plan.stopped == {0} and plan.done(0) and plan.done(1) and plan.all_done
    assert sorted(k for p, k in fins if p == 0) == [0, 1, 2] and aborted == []
    assert plan.num_unsent(0) == 5 and plan.num_unsent(1) == 0
    assert sorted(k for p, k in fins if p == 1) == list(range(8))


def test_path_check_aborts_the_running_paths_of_a_stopped_problem():
    def check(p, answers, remaining):  # stop problem 0 once it has 2 answers
        return p == 0 and len(answers) == 2

    plan = PathPlanner(2, n=6, schedule=Schedule(waves=(4, REST), capacity=6, check="path",
                                                 fill_idle=False), stop_check=check)
    assert plan.admit() == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    # one answer: no stop yet; the freed row goes to problem 1's first wave
    assert plan.on_finish(0, 1, "a") == ([(1, 2)], [])
    submit, abort = plan.on_finish(0, 3, "a")
    assert abort == [(0, 0), (0, 2)] and plan.stopped == {0}
    assert submit == [(1, 3)] and plan.num_inflight == 4
    assert plan.on_finish(0, 0, "late") == ([], [])  # an aborted path finishing is ignored
    assert plan.done(0) and plan.num_unsent(0) == 2 and not plan.all_done


def test_path_check_is_asked_after_every_path_and_wave_check_is_not():
    for check_mode, expected in (("path", [1, 2, 3, 4, 5]), ("wave", [2, 4])):
        seen = []
        plan = PathPlanner(1, n=6, schedule=Schedule(waves=(2, 2, REST), check=check_mode),
                           stop_check=lambda p, a, r: seen.append(len(a)) or False)
        simulate(plan, [[1, 2, 3, 4, 5, 6]])
        assert seen == expected, check_mode


def test_nothing_remaining_means_no_check():
    for check in ("index", "wave", "path"):
        seen = []
        plan = PathPlanner(1, n=2, schedule=Schedule(waves=(REST,), check=check),
                           stop_check=lambda p, a, r: seen.append(r) or False)
        simulate(plan, [[1, 1]])
        assert plan.all_done and not plan.stopped and 0 not in seen, check
        assert seen == ([] if check == "wave" else [1]), check


def test_index_check_votes_in_path_order_and_stops_the_running_siblings():
    seen = []

    def check(p, answers, remaining):
        seen.append((list(answers), remaining))
        return answers == ["a", "a", "a"]

    plan = PathPlanner(1, n=8, schedule=Schedule(waves=(2,), capacity=4), stop_check=check)
    assert plan.admit() == [(0, 0), (0, 1), (0, 2), (0, 3)]  # idle fill opened wave 1 too
    assert plan.on_finish(0, 1, "b")[1] == []  # path 0 still runs: no look
    assert seen == []
    plan.on_finish(0, 0, "a")  # paths 0 and 1 done: the looks at 1 and 2, in path order
    assert seen == [(["a"], 7), (["a", "b"], 6)]
    plan.on_finish(0, 3, "a")  # path 2 still runs: no look
    assert len(seen) == 2
    submit, abort = plan.on_finish(0, 2, "a")
    assert seen[2:] == [(["a", "b", "a"], 5), (["a", "b", "a", "a"], 4)]
    assert plan.stopped == set() and abort == []
    plan = PathPlanner(1, n=8, schedule=Schedule(waves=(2,), capacity=4), stop_check=check)
    plan.admit()
    for k in (0, 1):
        plan.on_finish(0, k, "a")
    submit, abort = plan.on_finish(0, 2, "a")  # the look at 3 stops: path 3 and the rest go
    assert plan.stopped == {0} and (0, 3) in abort and not submit
    assert plan.num_inflight == 0 and plan.all_done


# ---------------------------------------------------------------------------
# Filling idle rows at the tail
# ---------------------------------------------------------------------------


def test_idle_rows_start_later_waves_once_every_problem_is_admitted():
    plan = PathPlanner(2, n=6, schedule=Schedule(waves=(2, 2, REST), capacity=6))
    # both first waves, then the rows left start second waves, oldest first
    assert plan.admit() == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3)]
    strict = PathPlanner(2, n=6, schedule=Schedule(waves=(2, 2, REST), capacity=6, fill_idle=False))
    assert strict.admit() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # while new problems wait, they get the free rows instead
    busy = PathPlanner(5, n=6, schedule=Schedule(waves=(2, 2, REST), capacity=6))
    assert busy.admit() == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_early_waves_do_not_enter_an_earlier_waves_vote_and_stop_aborts_them():
    seen = []

    def check(p, answers, remaining):
        seen.append((list(answers), remaining))
        return answers == ["a", "a"]

    plan = PathPlanner(1, n=6, schedule=Schedule(waves=(2, 2, REST), capacity=4, check="wave"),
                       stop_check=check)
    assert plan.admit() == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert plan.on_finish(0, 2, "b") == ([(0, 4)], [])  # wave 1 path first: no vote due yet
    assert plan.on_finish(0, 0, "a") == ([(0, 5)], [])
    assert seen == []
    submit, abort = plan.on_finish(0, 1, "a")  # wave 0 done: its vote alone, 4 remaining
    assert seen == [(["a", "a"], 4)]
    assert submit == [] and abort == [(0, 3), (0, 4), (0, 5)]
    assert plan.stopped == {0} and plan.all_done and plan.num_inflight == 0


def test_waves_are_checked_in_order_when_a_later_one_finishes_first():
    seen = []
    plan = PathPlanner(1, n=6, schedule=Schedule(waves=(2, 2, REST), capacity=6, check="wave"),
                       stop_check=lambda p, a, r: seen.append((len(a), r)) or False)
    assert len(plan.admit()) == 6
    for k in (2, 3, 4, 0):
        plan.on_finish(0, k, "x")
    assert seen == []
    plan.on_finish(0, 1, "x")  # waves 0 and 1 both complete now: two votes, in order
    assert seen == [(2, 4), (4, 2)]
    plan.on_finish(0, 5, "x")
    assert plan.all_done and not plan.stopped


def test_fill_idle_is_validated_and_described():
    with pytest.raises(ValueError, match="fill_idle"):
        Schedule(fill_idle=1)
    assert Schedule(waves=(4,), fill_idle=False).describe() == "4+no-fill"
    for schedule in (Schedule(waves=(4,), fill_idle=False), Schedule(waves=(2, REST), check="path"),
                     Schedule(waves=(1, 2), fill_idle=False, check="path")):
        assert Schedule.parse(schedule.describe()) == schedule  # round trip
    with pytest.raises(ValueError, match="flag"):
        Schedule.parse("4+eager")
    assert Schedule(waves=(4,)).may_abort and Schedule(waves=(4,), fill_idle=False).may_abort
    assert not Schedule(waves=(4,), fill_idle=False, check="wave").may_abort
    assert not Schedule(waves=(REST,), check="wave").may_abort
    assert Schedule(waves=(REST,), check="path").may_abort and ALL_AT_ONCE.may_abort
