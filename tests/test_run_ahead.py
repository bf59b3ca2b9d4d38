"""Run-ahead (consensus_spec.sampling.run_ahead): the worth of a later wave
(the chance the stop rule still needs it), the greedy choice against the
cost of a row, and the planner opening only the waves that pay."""

from __future__ import annotations

import random

import pytest

from consensus_spec.sampling.run_ahead import (LATE_WORTH, NONE_PSEUDO, RunAhead, need_probability,
                                               tally_keys)
from consensus_spec.sampling.stopping import StopRule, should_stop_ids
from consensus_spec.sampling.waves import PathPlanner, Schedule


class FixedCosts:
    """A step time T(B) = fixed + per_row * B."""

    def __init__(self, fixed: float, per_row: float, rows: int = 0):
        self.fixed, self.per_row, self._rows = fixed, per_row, rows

    def rows(self) -> int:
        return self._rows

    def elasticity(self, rows: int, extra: int) -> float:
        t = self.fixed + self.per_row * rows
        return rows * self.per_row * extra / (extra * t)


def _simulate(counts, none, looks, n, rule, trials, rng):
    """The same urn, drawn path by path, the rule at each look."""
    alive = 0
    for _ in range(trials):
        lead, others, nones = counts[0] if counts else 0, list(counts[1:]), none
        w = [lead + 1.0, sum(counts[1:]) + 1.0, none + NONE_PSEUDO]
        new_l = new_o = new_n = 0
        seen = sum(counts) + none
        stopped = False
        for look in looks:
            while seen + new_l + new_o + new_n < look:
                r = rng.random() * sum(w)
                k = 0 if r < w[0] else 1 if r < w[0] + w[1] else 2
                w[k] += 1
                new_l, new_o, new_n = new_l + (k == 0), new_o + (k == 1), new_n + (k == 2)
            second = (others[0] if others else 0) + new_o
            ranked = sorted([lead + new_l, second] + others[1:], reverse=True)
            ids = [c for c, m in enumerate(ranked) for _ in range(m)] + [None] * (nones + new_n)
            if should_stop_ids(ids, n - len(ids), rule):
                stopped = True
                break
        alive += not stopped
    return alive / trials


@pytest.mark.parametrize("counts,none,looks", [
    ((2,), 0, (4, 6, 8)),
    ((1, 1), 0, (4, 6)),
    ((3, 1), 1, (6, 8, 10)),
    ((), 2, (4,)),
])
def test_need_probability_matches_a_simulation_of_its_model(counts, none, looks):
    rule = StopRule()
    exact = need_probability(counts, none, looks, 16, rule)
    sim = _simulate(counts, none, looks, 16, rule, 20000, random.Random(7))
    assert 0.0 <= exact <= 1.0
    assert exact == pytest.approx(sim, abs=0.015)


def test_agreement_lowers_the_worth_of_later_waves():
    rule = StopRule()
    agreed = need_probability((4,), 0, (6,), 16, rule)
    split = need_probability((2, 2), 0, (6,), 16, rule)
    assert agreed < split
    # a wave behind two more looks is needed less than one behind one look
    assert need_probability((2,), 0, (4, 6), 16, rule) <= need_probability((2,), 0, (4,), 16, rule)
    # an already decided vote stops at the next look for sure
    assert need_probability((9,), 0, (10,), 16, rule) == 0.0


def test_tally_uses_canonical_keys_and_counts_no_answers():
    assert tally_keys(["1,000", "1000", "7", None, " "]) == ((2, 1), 2)


def test_choose_opens_best_worth_first_while_it_beats_the_cost():
    ahead = RunAhead(StopRule(), FixedCosts(fixed=1.0, per_row=1.0))  # kappa(B) = B / (1 + B)
    # at 1 row kappa is 0.5: q 0.9 and 0.7 open (rows 3 -> kappa 0.75), 0.6 does not
    chosen = ahead.choose([(0.6, 2, 0), (0.9, 2, 1), (0.7, 2, 2)], spare=10, rows=1,
                          next_candidate=lambda p: None)
    assert chosen == [1]  # after it, 3 rows: kappa 0.75 > 0.7
    free = RunAhead(StopRule(), None)  # no cost known: every row free
    assert free.choose([(0.6, 2, 0), (0.9, 2, 1), (0.7, 2, 2)], spare=4, rows=50,
                       next_candidate=lambda p: None) == [1, 2]  # spare bounds it
    assert ahead.stats.opened == 1 and ahead.stats.declined == 2


def test_a_late_run_opens_the_waves_its_vote_more_likely_needs_than_not():
    """Costly rows (kappa 1) open nothing, unless the run is later than the
    recent answers took: then waves worth more than LATE_WORTH open, the
    tail of answer times waiting on no more waves than it must."""
    late = {"now": False}
    ahead = RunAhead(StopRule(), FixedCosts(fixed=0.0, per_row=1.0), "throughput",
                     late=lambda: late["now"])
    waves = [(0.9, 2, 0), (0.6, 2, 1), (0.4, 2, 2)]
    assert ahead.choose(waves, spare=10, rows=8, next_candidate=lambda p: None) == []
    late["now"] = True
    assert LATE_WORTH == 0.5
    assert ahead.choose(waves, spare=10, rows=8, next_candidate=lambda p: None) == [0, 1]


def _planner(costs, rule=StopRule(), idle=100):
    return PathPlanner(1, n=16, schedule=Schedule(waves=(2,), capacity=64),
                       stop_check=lambda p, a, r: False, idle_rows=lambda: idle,
                       run_ahead=RunAhead(rule, costs))


def test_free_rows_open_every_wave_and_costly_rows_none():
    free = _planner(FixedCosts(fixed=100.0, per_row=0.0))  # a GPU at small batch
    assert len(free.admit()) == 16
    costly = _planner(FixedCosts(fixed=0.0, per_row=1.0))  # kappa 1: nothing pays
    assert len(costly.admit()) == 2  # the first wave only


@pytest.mark.parametrize("objective, opened", [("throughput", 1), ("latency", 7)])
def test_the_latency_objective_weighs_a_wave_against_the_waves_it_saves(objective, opened):
    # T = 4 + B, one problem holding 2 rows, every later wave worth 0.4.
    # Rows of work: kappa(B, 2) = B / (4 + B) passes 0.4 at B = 4, so one
    # wave opens.  The problem's latency: kappa = s b / (a + b s) = 1/3 at
    # every B (the wave it saves would run beside nothing), so all open.
    ra = RunAhead(None, FixedCosts(fixed=4.0, per_row=1.0), objective)
    chosen = ra.choose([(0.4, 2, 0)], spare=14, rows=2, next_candidate=lambda p: (0.4, 2),
                       own=(2, 1))
    assert chosen == [0] * opened
    assert ra.stats.declined == (0 if opened == 7 else 1)
    with pytest.raises(ValueError, match="objective"):
        RunAhead(None, None, "answers")


def test_problems_sharing_the_batch_hold_the_latency_objective_to_rows_of_work():
    # T = 4 + B.  One problem holding 4 rows, every later wave worth 0.6.
    # Alone (B = 4) the latency criterion opens all six waves of 2 (at B = 14,
    # 4 * 2 / 16 = 0.5 < 0.6).  Beside 7 other problems of 4 rows (B = 32,
    # k = 8) the latency criterion alone, 8 * 2 / T(30) = 0.47, would open a
    # wave; rows of work, kappa(32, 2) = 32 / 36 = 0.89, open none, and with
    # more than SHARED_PROBLEMS problems beside it that criterion binds.
    def opened(rows):
        ra = RunAhead(None, FixedCosts(fixed=4.0, per_row=1.0), "latency")
        return len(ra.choose([(0.6, 2, 0)], spare=12, rows=rows,
                             next_candidate=lambda p: (0.6, 2), own=(4, 1)))

    assert opened(rows=4) == 6
    assert opened(rows=32) == 0
    # two problems (k = 2): a third of the rows-of-work criterion, 0.27 at
    # B = 8, lets waves open until the latency criterion stops them
    assert opened(rows=8) == 6


def test_a_settling_vote_stops_run_ahead_and_a_split_one_keeps_it():
    def after_first_wave(answers):
        idle = {"rows": 2}
        costs = FixedCosts(fixed=1.0, per_row=1.0)  # kappa(2) = 2/3
        plan = PathPlanner(1, n=16, schedule=Schedule(waves=(2,), capacity=64),
                           stop_check=lambda p, a, r: False, idle_rows=lambda: idle["rows"],
                           run_ahead=RunAhead(StopRule(), costs, "throughput"))
        assert plan.admit() == [(0, 0), (0, 1)]  # only two rows idle
        idle["rows"] = 100
        # wave 1: the look after wave 0 (2 paths) cannot stop, so it is
        # needed for sure and starts when the first path is back
        early, _ = plan.on_finish(0, 0, answers[0])
        assert early == [(0, 2), (0, 3)]
        to_submit, to_abort = plan.on_finish(0, 1, answers[1])
        assert to_abort == []
        return to_submit

    agreed = after_first_wave(["5", "5"])  # wave 2 needed with chance 0.52 < kappa
    split = after_first_wave(["5", "7"])  # needed for sure: it pays
    assert agreed == []
    assert split[:2] == [(0, 4), (0, 5)]
