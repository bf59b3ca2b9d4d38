"""What a batch row costs a step (consensus_spec.budget.row_costs), learned
from timed steps, and its adapter fed by vLLM's per-step stats
(consensus_spec.server.step_costs)."""

from __future__ import annotations

import random

import pytest

from consensus_spec.budget import cost_model
from consensus_spec.budget.row_costs import PRIOR_STEPS, RowStepCosts
from consensus_spec.server.step_costs import EngineStepCosts


def _feed(costs, step, batches, rng, steps=3000, drafts_per_row=2.0, noise=0.1):
    for _ in range(steps):
        b = rng.choice(batches)
        d = int(drafts_per_row * b)
        costs.observe(b, d, step(b, d) * (1 + rng.gauss(0, noise)))


def test_kappa_of_a_linear_step_is_learned_whatever_the_prior():
    step = lambda b, d: 5.0 + 0.5 * b + 0.2 * d  # noqa: E731
    costs = RowStepCosts(cost_model("h200_7b"))  # a prior of another machine's shape
    _feed(costs, step, [4, 8, 16, 32, 64, 128], random.Random(0))
    for b in (8, 32, 128):
        true = b * (0.5 + 0.2 * 2.0) / step(b, 2 * b)
        assert costs.kappa(b) == pytest.approx(true, abs=0.05)
        assert costs.step_ms(b) == pytest.approx(step(b, 2 * b), rel=0.05)


def test_a_roofline_keeps_its_flat_part():
    step = lambda b, d: max(20.0, 0.4 * (b + d))  # noqa: E731  (flat until 50 tokens)
    costs = RowStepCosts(None)
    _feed(costs, step, [1, 2, 4, 8, 256, 512], random.Random(1), drafts_per_row=0.0)
    assert costs.kappa(2) < 0.1  # rows are nearly free at a small batch
    assert costs.kappa(512) > 0.8  # and cost their share at a large one


def test_without_steps_the_prior_answers_and_data_outweighs_it():
    prior = cost_model("cpu_embedded")
    costs = RowStepCosts(prior)
    assert costs.kappa(16) == pytest.approx(costs.prior_kappa(16))
    step = lambda b, d: 100.0 + 0.01 * b  # noqa: E731  (rows nearly free, unlike the prior)
    one = RowStepCosts(prior)
    _feed(one, step, [16], random.Random(2), steps=200, drafts_per_row=0.0, noise=0.02)
    assert one.kappa(16) == pytest.approx(one.prior_kappa(16), abs=0.02)  # one B: no slope
    _feed(costs, step, [8, 16, 32], random.Random(2), steps=int(20 * PRIOR_STEPS),
          drafts_per_row=0.0, noise=0.02)
    assert costs.prior_kappa(16) > 0.3 and costs.kappa(16) < 0.1


def test_a_hiccup_is_clipped_not_believed():
    costs = RowStepCosts(None)
    _feed(costs, lambda b, d: 10.0 + b, [8, 16], random.Random(3), steps=500, noise=0.02)
    before = costs.step_ms(16)
    costs.observe(16, 0, 1e6)
    assert costs.steps_clipped == 1 and costs.step_ms(16) == pytest.approx(before, rel=0.05)
    assert not costs.observe(0, 0, 5.0) and not costs.observe(4, 0, float("nan"))


def test_engine_costs_time_steps_between_stats_and_skip_prefills_and_idle():
    engine = EngineStepCosts("cpu_embedded")
    t = 100.0
    engine.record(0, running=8, drafted=0, prefill=False, now=t)  # first: nothing to time
    for i in range(50):
        t += 0.020
        engine.record(0, running=8, drafted=16, prefill=(i == 10), now=t)
    assert engine.steps_seen == 51 and engine.steps_used == 49  # the prefill step left out
    assert engine.fit.step_ms(8) == pytest.approx(20.0, rel=0.05)
    engine.record(0, running=0, drafted=0, prefill=False, now=t + 0.02)
    engine.record(0, running=4, drafted=0, prefill=False, now=t + 60.0)  # after an idle engine
    assert engine.steps_used == 50 and engine.rows() == 4
    assert 0.0 <= engine.elasticity(8, 2) <= 1.0 and engine.elasticity(0, 2) == 0.0
