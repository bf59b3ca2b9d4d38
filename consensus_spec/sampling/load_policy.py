"""How a shared engine's load picks a self-consistency request's schedule
(pure logic, no vLLM).

A request that leaves its schedule to the server runs its problems one
of two ways:

``all``
    Every path at once, as an ``n``-path request would run, and the vote
    after each path in path order still ends the paths in flight once it
    is settled (the tail cut; a vote that no remaining path can change
    ends them too, whichever paths finished).  Nothing waits on a wave,
    so the answer comes when the vote settles.
``waves``
    Waves of 4, 4 and the rest while every problem in flight's wave of 4
    fits in half the batch (the other half is for the later waves the
    votes ask for), else waves of 2 (:class:`~consensus_spec.sampling.waves.Schedule`'s
    default); later waves started early only where they pay
    (:mod:`~consensus_spec.sampling.run_ahead`): paths a settled vote
    never needs are never sent.

Which one is a question of rows.  While every problem in flight, this one
included, could hold all of its paths in the engine's batch at once
(beside the other requests' rows and the queue), waves would only make its
answer wait: a path started later cannot finish sooner, and on a GPU a
step costs about the same at 16 rows as at 128.  Once they could not, the
paths of ``n``-at-once problems queue behind each other (vLLM's queue is
first come, first served) and every path a settled vote did not need
delays someone else's answer: the engine is saturated and waves pay.

So the choice counts problems, not the rows busy at this instant: a
problem in flight counts its ``n`` paths however many it runs now (a
problem in waves would take them all in the ``all`` mode, and counting
only its running paths would let ``all`` problems crowd ``waves`` ones
into a mix where the waves wait longest), and so do requests that arrived
together and have not chosen yet (a server counts them from their parse).
The step's cost per row, measured from the engine's own steps, is reported
beside the choice and prices which later waves start early once a problem
waves (:class:`~consensus_spec.sampling.run_ahead.RunAhead`).  It does not
move the switch: where a row costs about its share of the step (this
CPU), waves at low load would buy answers per second with a longer tail
than the ``n``-path request's; the switch keeps that tail.

On this repository's 2-core CPU (embedded model, vLLM's default 128
rows) ``all`` holds up to 8 clients sending ``n=16``; with more, waves.
The wave size is the tail's: with waves of 2 an unsettled problem runs up
to 8 waves one after another, and at 16 clients its p95 was 1.17-1.26x
that of ``n=16`` at once; waves of 4, 4, rest (at most 3) gave 0.99-1.07x
and more answers a second (3 runs).  At 32 clients waves of 4 fill the
batch with first waves, the later ones queue behind new problems, and the
p95 grew (1.24-1.29x against 0.99-1.19x, 2 runs): there waves of 2 stay.
``python -m evals serve-sc`` measures both sides (docs/server.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from .waves import REST, Schedule

__all__ = ["ALL", "REQUESTED", "WAVES", "EngineLoad", "ScheduleChoice", "choose_schedule",
           "requested"]

ALL, WAVES, REQUESTED = "all", "waves", "requested"
FEW_WAVES = (4, 4, REST)  # while each problem's wave of 4 fits in half the batch (module docstring)


@dataclass(frozen=True)
class EngineLoad:
    """What the server measures when a request arrives.

    ``max_rows``: the engine's batch rows (``--max-num-seqs``);
    ``rows_busy`` and ``waiting``: requests running and queued in the
    engine at its last step (every route's); ``other_rows``: of those, the
    ones that are not self-consistency paths; ``problems_in_flight``: the
    self-consistency problems not yet answered, ``problem_rows`` the sum of
    their ``n`` (the rows they would hold at once); ``row_cost``: the step
    time's elasticity in rows at ``rows_busy`` (``B dT/dB / T``: 0 when a
    row is free, 1 when the step grows in proportion), None when not
    measured: reported beside the choice, and what run-ahead prices rows by."""

    max_rows: int
    rows_busy: int = 0
    waiting: int = 0
    other_rows: int = 0  # rows and queue places of requests that are not self-consistency paths
    problem_rows: int = 0  # sum of n over the self-consistency problems in flight
    problems_in_flight: int = 0
    row_cost: float | None = None


@dataclass(frozen=True)
class ScheduleChoice:
    """The schedule a request ran with and why (``schedule_used`` in each
    response, the last one in the state route)."""

    mode: str  # ALL, WAVES or REQUESTED (the request or the server's defaults named one)
    schedule: str  # Schedule.describe() of the schedule run
    reason: str
    rows_wanted: int = 0  # rows every problem in flight, this request's too, would hold at once
    max_rows: int = 0
    rows_busy: int = 0
    waiting: int = 0
    problems_in_flight: int = 0  # before this request
    row_cost: float | None = None

    def as_dict(self) -> dict:
        out = asdict(self)
        if out["row_cost"] is not None:
            out["row_cost"] = round(out["row_cost"], 3)
        return out


def choose_schedule(load: EngineLoad, problems: int, n: int,
                    waves: Schedule) -> tuple[Schedule, ScheduleChoice]:
    """The schedule for a request of ``problems`` problems of ``n`` paths
    arriving at ``load`` (module docstring): every path at once, waves of
    :data:`FEW_WAVES` or ``waves`` (its capacity, check and fill kept
    throughout), and the choice as reported."""
    if problems < 1 or n < 1:
        raise ValueError(f"problems and n must be >= 1, got {problems}, {n}")
    wanted = load.other_rows + load.problem_rows + problems * n
    others = load.problems_in_flight
    beside = f"{others} other problem{'s' if others != 1 else ''} in flight"
    if load.other_rows:
        beside += f", {load.other_rows} rows of other requests"
    if wanted <= load.max_rows:
        schedule = dataclasses.replace(waves, waves=(REST,))
        mode, reason = ALL, f"{beside}: {wanted} of {load.max_rows} rows hold every path at once"
    else:
        mode, reason = WAVES, f"{beside}: {wanted} rows wanted, {load.max_rows} in the batch"
        if (others + problems) * FEW_WAVES[0] <= load.max_rows // 2:
            schedule = dataclasses.replace(waves, waves=FEW_WAVES)
            reason += f"; waves of {FEW_WAVES[0]} for {others + problems} problems fit in half of it"
        else:
            schedule = waves
    return schedule, ScheduleChoice(mode, schedule.describe(), reason, wanted, load.max_rows,
                                    load.rows_busy, load.waiting, others, load.row_cost)


def requested(schedule: Schedule, early_stop: bool = True) -> ScheduleChoice:
    """The choice reported when the load did not choose: the request (or the
    server's defaults) named the schedule, or early stop is off (every path runs)."""
    if not early_stop and schedule.all_at_once:
        return ScheduleChoice(ALL, schedule.describe(), "early stop off: every path runs")
    return ScheduleChoice(REQUESTED, schedule.describe(), "the request named its schedule")
