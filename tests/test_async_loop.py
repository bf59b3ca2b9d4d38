"""run_paths_async against a fake async engine client (no vLLM): the same
votes and stops as the step-driven run_paths, aborts of stopped paths, and
nothing left running after an error or a cancellation."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from consensus_spec.sampling.async_loop import run_paths_async
from consensus_spec.sampling.engine_loop import run_paths
from consensus_spec.sampling.stopping import StopRule
from consensus_spec.sampling.waves import Schedule
from tests.test_self_consistency import FakeEngine, params_factory, script_from


class FakeAsyncEngine:
    """``generate``/``abort`` like vLLM's EngineClient: one chunk per tick;
    DELTA params get every chunk, FINAL_ONLY ones (``params.delta`` False)
    only the final output, or on abort one final output with the tokens so
    far, as ``AsyncLLM`` sends; ``slots`` requests advance per tick, FCFS."""

    def __init__(self, script, slots=1000, fail_on=None):
        self.script, self.slots, self.fail_on = script, slots, fail_on
        self.running: dict[str, bool] = {}  # rid -> still wanted
        self.aborted: list[str] = []
        self.added: list[str] = []
        self.order: list[str] = []
        self.generated = 0  # tokens the engine produced, aborted paths' included

    @staticmethod
    def _out(rid, params, chunks, i, finish):
        text, ids = (chunks[i], [7]) if params.delta else ("".join(chunks[:i + 1]), [7] * (i + 1))
        return SimpleNamespace(request_id=rid, finished=finish is not None, outputs=[SimpleNamespace(
            text=text, token_ids=ids, cumulative_logprob=params.logprob * (i + 1),
            finish_reason=finish)])

    async def generate(self, rid, prompt, params):
        chunks = self.script(prompt, params)
        self.added.append(rid)
        self.running[rid] = True
        try:
            for i in range(len(chunks)):
                await asyncio.sleep(0)
                if not self.running.get(rid):
                    if not params.delta and i > 0:  # the final output of an abort
                        yield self._out(rid, params, chunks, i - 1, "abort")
                    return
                if self.fail_on is not None and rid.endswith(self.fail_on) and i == 1:
                    raise RuntimeError("engine failure")
                self.generated += 1
                done = i == len(chunks) - 1
                if params.delta or done:
                    yield self._out(rid, params, chunks, i, "stop" if done else None)
        finally:
            self.running.pop(rid, None)

    async def abort(self, rids):
        for rid in rids:
            self.aborted.append(rid)
            self.running.pop(rid, None)


TABLE = [
    [("5", 3), ("5", 1), ("5", 2), ("5", 4), ("5", 2), ("6", 9), ("5", 30), ("5", 30)],
    [("1", 2), ("2", 2), ("3", 5), ("1", 1), ("2", 3), ("1", 2), ("1", 2), ("2", 2)],
    [("7", 2), ("7", 2), ("7", 5), ("7", 1), ("7", 3), ("7", 2), ("7", 40), ("7", 40)],
]


def _summary(run):
    return [(r.answer, r.counts, r.stopped_early, len(r.samples)) for r in run]


@pytest.mark.parametrize("schedule", [Schedule(waves=(2,), capacity=4), Schedule(waves=(4, "rest")),
                                      Schedule(waves=("rest",))])
@pytest.mark.parametrize("rule", [None, StopRule(kind="margin", margin=2, min_samples=1)])
@pytest.mark.parametrize("delta", [True, False])
def test_votes_match_the_step_driven_loop(schedule, rule, delta):
    engine = FakeAsyncEngine(script_from(TABLE))
    make = params_factory(delta=delta)
    run = asyncio.run(run_paths_async(engine.generate, engine.abort, ["a", "b", "c"], make, 8,
                                      schedule=schedule, stop_rule=rule, delta=delta))
    ref = run_paths(FakeEngine(script_from(TABLE)), ["a", "b", "c"], make, 8,
                    schedule=schedule, stop_rule=rule, delta=True)
    assert [r.answer for r in run] == ["5", "1", "7"]
    # every token the engine made is counted, aborted paths' too, DELTA or final-only
    assert run.num_tokens == engine.generated
    if rule is None or schedule.all_at_once:
        assert _summary(run) == _summary(ref)  # same paths voted: same result
    assert not engine.running
    if rule is not None and not schedule.all_at_once:
        assert run[0].stopped_early and run[2].stopped_early
        assert run[2].num_aborted > 0 and run.num_tokens < sum(l + 1 for row in TABLE for _, l in row)
        # every aborted path's id reached the engine's abort
        started_not_done = {rid for rid in engine.added
                            if not any(rid.endswith(f"-{r.index}-{s.path}") for r in run for s in r.samples)}
        assert started_not_done <= set(engine.aborted)


@pytest.mark.parametrize("delta", [True, False])
def test_an_aborted_paths_tokens_are_counted(delta):
    """Idle fill starts six long paths beside the first wave; the first wave
    agrees, so they are aborted part-way: their tokens are in the count, from
    DELTA outputs or from the final output an abort sends."""
    engine = FakeAsyncEngine(script_from([[("5", 1), ("5", 2)] + [("6", 50)] * 6]))
    run = asyncio.run(run_paths_async(
        engine.generate, engine.abort, ["a"], params_factory(delta=delta), 8,
        schedule=Schedule(waves=(2,), capacity=8), delta=delta,
        stop_rule=StopRule(kind="margin", margin=2, min_samples=1)))
    (r,) = run
    assert r.stopped_early and r.num_aborted == 6 and r.aborted_tokens >= 6
    assert run.num_tokens == engine.generated and not engine.running


def test_engine_error_aborts_every_running_path_and_raises():
    engine = FakeAsyncEngine(script_from(TABLE), fail_on="-1-2")
    with pytest.raises(RuntimeError, match="engine failure"):
        asyncio.run(run_paths_async(engine.generate, engine.abort, ["a", "b", "c"],
                                    params_factory(delta=True), 8))
    assert not engine.running and engine.aborted


def test_cancellation_aborts_every_path_it_started():
    engine = FakeAsyncEngine(script_from([[("1", 10_000)] * 4]))
    inflight = []

    async def main():
        task = asyncio.create_task(run_paths_async(
            engine.generate, engine.abort, ["a"], params_factory(delta=True), 4,
            on_submit=inflight.append))
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(engine.running) == 4
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert not engine.running
    assert sorted(engine.aborted) == sorted(engine.added)
    assert sum(inflight) == 0  # the caller's in-flight count returns to zero


def test_idle_fill_opens_early_waves_only_into_rows_idle_engine_wide():
    from consensus_spec.sampling.waves import PathPlanner

    sched = Schedule(waves=(2,), capacity=8)
    assert len(PathPlanner(1, 8, sched).admit()) == 8  # own capacity: every wave at once
    assert len(PathPlanner(1, 8, sched, idle_rows=lambda: 0).admit()) == 2  # the first wave always
    assert len(PathPlanner(1, 8, sched, idle_rows=lambda: 4).admit()) == 4  # 2 idle rows after it
    assert len(PathPlanner(1, 8, sched, idle_rows=lambda: 6).admit()) == 6  # several waves at once
    assert len(PathPlanner(1, 8, sched, idle_rows=lambda: 99).admit()) == 8  # up to its capacity
    busy = PathPlanner(1, 8, sched, idle_rows=lambda: 0)
    busy.admit()
    busy.on_finish(0, 0, "1")
    to_submit, _ = busy.on_finish(0, 1, "2")
    assert to_submit == [(0, 2), (0, 3)]  # the next wave is due: sent whatever the load
