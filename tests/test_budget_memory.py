"""Step costs from a measured prior and remembered per machine: the table a
fit exports seeds the next one; the file is written atomically and a
corrupt, stale or foreign one is ignored with one WARNING; with a measured
prior the guard's plain windows and exploration run only where the engine
disagrees with it, and stop once the answer is clear."""

import gc
import json
import logging
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

from consensus_spec import ConsensusProposer
from consensus_spec.budget import COST_MODELS, DraftBudget, remember
from consensus_spec.budget.online import DRAFTED, bucket_of
from tests.test_online_costs import Clock, Siblings, linear_truth
from tests.test_online_costs import drive as online_drive

K = 8


def gpu_truth(batch, drafted):
    """An H200-like step (ms): a weight-read floor, draft tokens cheap but not free."""
    return 20.0 + 0.05 * batch + 0.3 * drafted


def drive(budget, truth, batch, steps, rng, drafter_ms=0.0, guard_sees=True):
    """Synthetic steps through the budget, the guard fed every step too with
    the tokens their drafts promise (``guard_sees=False``: in proportion to
    the step's time, so the guard finds both policies alike and a test
    watches the table alone); a step that drafts also takes ``drafter_ms``."""
    online_drive(budget, truth, batch, steps, rng, throughput=True, drafter_ms=drafter_ms,
                 gives="promised" if guard_sees else "neutral")


def slope(budget, batch):
    t = budget.costs.step_ms(batch, batch, drafter=False)
    return (t[batch] - t[0]) / batch


@pytest.fixture(scope="module")
def learned_rows():
    budget = DraftBudget(COST_MODELS["h200_7b"], online=True)
    drive(budget, gpu_truth, 64, 600, np.random.default_rng(0))
    return budget.costs.export()


def test_an_exported_fit_seeds_the_same_fit(learned_rows):
    assert {r["B"] for r in learned_rows} == {64} and len(learned_rows) == 5
    budget = DraftBudget(COST_MODELS["h200_7b"], online=True, measured=learned_rows)
    t = budget.costs.step_ms(64, 8 * 64, drafter=False)
    for r in learned_rows:
        assert t[int((r["q"] - 1) * 64)] == pytest.approx(r["ms"], rel=1e-3)
    assert budget.costs.settled(64) and not budget.costs.settled(16)


def test_a_malformed_row_is_refused():
    budget = DraftBudget(COST_MODELS["h200_7b"], online=True)
    with pytest.raises(ValueError):
        budget.costs.seed([{"B": 8, "q": 1, "ms": -1.0}])


def test_a_measured_prior_that_holds_costs_no_exploration_and_a_window_in_max_period(learned_rows):
    from consensus_spec.budget.guard import MAX_PERIOD, WINDOW

    fresh = DraftBudget(COST_MODELS["h200_7b"], online=True)
    drive(fresh, gpu_truth, 64, 800, np.random.default_rng(1))
    paid = fresh.learning_cost()["forced_plain_steps"]  # what a cold start pays
    budget = DraftBudget(COST_MODELS["h200_7b"], online=True, measured=learned_rows)
    drive(budget, gpu_truth, 64, 800, np.random.default_rng(1))
    cost = budget.learning_cost()
    assert cost["explored_steps"] == 0 and cost["windows_skipped"] > 0
    # due windows are put off until MAX_PERIOD steps have passed: two windows in 800 steps
    assert cost["forced_plain_steps"] == WINDOW * (800 // MAX_PERIOD) < paid
    assert cost["disagreements"] == 0 and cost["measured_buckets"] == 1


def test_a_measured_prior_that_holds_still_checks_that_drafting_pays_for_its_drafter(learned_rows):
    """The table is right about the engine's steps, but the drafter's own time
    (which the table leaves out) eats more than drafts gain: the rare windows
    find it, look sooner, and switch drafting off."""
    budget = DraftBudget(COST_MODELS["h200_7b"], online=True, measured=learned_rows)
    batch = 64
    drive(budget, gpu_truth, batch, 1500, np.random.default_rng(3), drafter_ms=15.0)
    assert budget.costs.settled(batch) and budget.costs.disagreements == 0
    assert budget.guard.summary()["drafting_off_at_rows"] == [64]


def test_an_engine_that_disagrees_is_learned_then_settles_again(learned_rows):
    """Truth: draft tokens cost three times what the table says."""
    tripled = lambda b, m: 20.0 + 0.05 * b + 0.9 * m  # noqa: E731
    budget = DraftBudget(COST_MODELS["h200_7b"], online=True, measured=learned_rows)
    rng = np.random.default_rng(2)
    drive(budget, tripled, 64, 1500, rng, guard_sees=False)
    cost = budget.learning_cost()
    assert cost["disagreements"] >= 1 and cost["resettled"] >= 1
    # drafts cost more than the table said, enough that none pays (at 0.9 ms
    # a token against 0.36 ms per row's token, none does): the decision is clear
    assert slope(budget, 64) > 1.4 * 0.3
    assert budget.costs.summary(64)["ms_per_step"][1] > 1.25 * gpu_truth(64, 64)
    # settled on the new answer: learning stops (a probe now and then, which
    # finds drafts no cheaper and leaves the answer as it was)
    before = budget.learning_cost()
    drive(budget, tripled, 64, 400, rng, guard_sees=False)
    after = budget.learning_cost()
    assert budget.costs.settled(64)
    assert after["forced_plain_steps"] - before["forced_plain_steps"] <= 4
    assert after["explored_steps"] - before["explored_steps"] <= 2
    assert after["probed_steps"] - before["probed_steps"] <= 3


def kinked(batch, drafted):
    """An H200-like step whose cost jumps once a row's query passes 2 tokens:
    a shape the bucket's three-term fit does not follow exactly."""
    q = 1.0 + drafted / batch
    return 20.0 + 0.05 * batch + (0.1 * drafted if q <= 2.0 else 0.1 * batch + 0.5 * (drafted - batch))


def test_a_table_the_engine_agrees_with_is_saved_as_it_came():
    """A profile's points go back to the next start unchanged while the engine
    agrees with them; saving the fit instead lost the kink and drifted run by run."""
    table = [{"B": 64, "q": q, "ms": kinked(64, (q - 1) * 64), "noise": 0.03}
             for q in (1, 1.25, 1.5, 2, 3, 5, 9)]
    budget = DraftBudget(COST_MODELS["h200_7b"], online=True, measured=table)
    # the guard fed as in test_online_costs, and fewer steps than its first window in a
    # settled bucket (MAX_PERIOD): this test is about the table, the guard's are above
    online_drive(budget, kinked, 64, 350, np.random.default_rng(3), throughput=True)
    assert budget.learning_cost()["disagreements"] == 0
    saved = budget.costs.export()
    assert [(r["B"], r["q"], r["ms"], r["noise"]) for r in saved] == \
        [(r["B"], r["q"], r["ms"], r["noise"]) for r in table]
    assert all(r["drafter_ms"] > 0 for r in saved)  # the drafter's time as measured
    # once the engine contradicts it, what is saved is what the engine said
    tripled = lambda b, m: 20.0 + 0.05 * b + 0.9 * m  # noqa: E731
    online_drive(budget, tripled, 64, 1200, np.random.default_rng(4), throughput=True)
    assert budget.learning_cost()["disagreements"] >= 1
    relearned = budget.costs.export()
    assert sorted(r["q"] for r in relearned) == [1, 2, 3, 5, 9]
    at9 = next(r["ms"] for r in relearned if r["q"] == 9)
    assert at9 > 1.25 * kinked(64, 8 * 64)


# -- the file ------------------------------------------------------------------

KEY = {"model": "m", "dtype": "float32", "device": "test", "tp": 1, "dp": 1, "vllm": "0"}


def test_save_is_atomic_and_load_checks_key_format_and_age(tmp_path, learned_rows):
    path = remember.path_for(KEY, str(tmp_path))
    remember.save(path, KEY, COST_MODELS["h200_7b"], learned_rows, [128])
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # no temporary left behind
    table, problem = remember.load(path, KEY)
    assert problem is None and table["prior"] == COST_MODELS["h200_7b"]
    assert table["drafting_off_at_rows"] == [128] and len(table["rows"]) == 5
    assert remember.load(str(tmp_path / "none.json"), KEY) == (None, None)
    for other_key, now in ((dict(KEY, device="other"), None),
                           (KEY, time.time() + remember.MAX_AGE_S + 60)):
        table, problem = remember.load(path, other_key, now=now)
        assert table is None and problem
    with open(path, "w") as f:
        f.write('{"format": 1, "key": ')  # cut short
    assert remember.load(path, KEY)[1].startswith("unreadable")
    with open(path, "w") as f:
        json.dump({"format": 1, "key": KEY, "saved_at": time.time(), "prior": [1, 1, 0, 2],
                   "rows": [{"B": 8, "q": 1, "ms": float("nan")}]}, f)
    assert remember.load(path, KEY)[0] is None


# -- the proposer ------------------------------------------------------------------


def stand_in(directory, **options):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=K),
        model_config=SimpleNamespace(max_model_len=4096, model="test-model", dtype="float32"),
        scheduler_config=SimpleNamespace(max_num_seqs=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_size=1),
        device_config=SimpleNamespace(device_type="cpu", device_name="test-cpu"),
        additional_config={"consensus_spec": {"warmup": False, "step_costs_dir": str(directory),
                                              **options}},
    )


def run_proposer(cfg, steps=300):
    proposer = ConsensusProposer(cfg)
    clock = Clock()
    proposer.clock = clock
    text = [10 + (t * 3) % 10 for t in range(steps + 40)]
    run = Siblings(proposer, 8, text, clock, linear_truth)
    for _ in range(steps):
        run.step()
    return proposer


def warnings_of(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING and "consensus_spec" in r.name]


def test_the_next_engine_starts_from_what_the_last_one_learned(tmp_path, caplog):
    first = run_proposer(stand_in(tmp_path))
    path = first.save_step_costs()
    assert path and os.path.dirname(path) == str(tmp_path)
    assert first.counters()["cost_model"] == "cpu_embedded"
    second = ConsensusProposer(stand_in(tmp_path))
    c = second.counters()
    assert c["cost_model"] == "cpu_embedded (remembered)" and c["step_costs_file"] == path
    assert c["learning_cost"]["measured_buckets"] >= 1
    a = first.budget.costs.step_ms(8, 16, drafter=False)
    b = second.budget.costs.step_ms(8, 16, drafter=False)
    assert b == pytest.approx(a, rel=1e-3)
    assert not warnings_of(caplog)


def test_a_corrupt_file_is_one_warning_and_the_default_prior(tmp_path, caplog):
    first = run_proposer(stand_in(tmp_path), steps=200)
    path = first.save_step_costs()
    with open(path, "wb") as f:
        f.write(b"\x00garbage")
    caplog.set_level(logging.INFO)
    proposer = ConsensusProposer(stand_in(tmp_path))
    assert len(warnings_of(caplog)) == 1 and "not used" in warnings_of(caplog)[0].getMessage()
    assert proposer.counters()["cost_model"] == "cpu_embedded"
    assert proposer.budget.costs.measured_buckets() == 0


def test_the_last_save_comes_when_the_proposer_goes_and_makes_a_fresh_folder(tmp_path):
    # an engine shut down and collected before the process ends (each evals run), having
    # timed too few steps for a periodic save (256 rows), on a fresh machine (no cache
    # folder yet): what it learned is still remembered
    fresh = tmp_path / "cache" / "step_costs"
    proposer = run_proposer(stand_in(fresh), steps=200)
    assert proposer._memory.saves == 0 and not fresh.exists()
    learned = proposer.budget.costs.step_ms(8, 16, drafter=False)
    del proposer
    gc.collect()
    files = os.listdir(fresh)
    assert len(files) == 1
    second = ConsensusProposer(stand_in(fresh))
    assert second.counters()["cost_model"] == "cpu_embedded (remembered)"
    assert second.budget.costs.step_ms(8, 16, drafter=False) == pytest.approx(learned, rel=1e-3)
    # a folder that was there and went away while the engine ran stays gone
    there = tmp_path / "there"
    there.mkdir()
    other = run_proposer(stand_in(there), steps=200)
    there.rmdir()
    del other
    gc.collect()
    assert not there.exists()


def test_remembering_can_be_turned_off_and_needs_auto(tmp_path):
    for options in ({"remember_costs": False}, {"cost_model": "cpu_embedded"}):
        proposer = run_proposer(stand_in(tmp_path, **options), steps=200)
        assert proposer.save_step_costs() is None
        assert proposer.counters()["step_costs_file"] is None
    assert os.listdir(tmp_path) == []


def test_a_failing_save_is_one_warning_and_drafting_goes_on(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    proposer = run_proposer(stand_in(blocked), steps=200)
    assert proposer.save_step_costs() is None and proposer.save_step_costs() is None
    assert len(warnings_of(caplog)) == 1
    assert proposer.counters()["num_drafted"] > 0


def overstated(factor):
    """gpu_truth's table at 16 rows, with a draft token ``factor`` times its true cost."""
    return [{"B": 16, "q": q, "ms": gpu_truth(16, 0) + factor * 0.3 * 16 * (q - 1), "noise": 0.03}
            for q in (1, 2, 3, 5, 9)]


def test_a_table_that_overstates_what_drafts_cost_is_found_out():
    """A remembered table can say drafts cost six times what they do (learned
    where the budget drafted deep, say): the budget then drafts nothing, so no
    window or exploration can see it. Its probes do, and drafting resumes."""
    budget = DraftBudget(COST_MODELS["h200_7b"], online=True, measured=overstated(6))
    rng = np.random.default_rng(3)
    drive(budget, gpu_truth, 16, 150, rng)
    assert budget.costs.steps_probed > 0 and budget.costs.disagreements >= 1
    drive(budget, gpu_truth, 16, 300, rng)
    assert 0.5 * 0.3 < slope(budget, 16) < 1.5 * 0.3
    assert budget.costs._state[bucket_of(16), DRAFTED] * 16 > 1.0  # it drafts again
    assert budget.learning_cost()["probed_steps"] <= 6


def test_probes_cost_little_where_drafting_never_pays():
    """The same table told true (a draft token at 3 ms a row: none pays):
    probes agree, grow rarer, and give up under 1% of the tokens."""
    truth = lambda b, m: 20.0 + 0.05 * b + 3.0 * m  # noqa: E731
    rows = [{"B": 16, "q": q, "ms": truth(16, (q - 1) * 16), "noise": 0.03} for q in (1, 2, 3, 5, 9)]
    budget = DraftBudget(COST_MODELS["h200_7b"], online=True, measured=rows)
    drive(budget, truth, 16, 2000, np.random.default_rng(4))
    cost = budget.learning_cost()
    assert 0 < cost["probed_steps"] <= 15 and cost["share_given_up"] < 0.01
    assert budget.costs.settled(16)
