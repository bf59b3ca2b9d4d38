import json

import arctic_inference  # noqa: F401 - declared (evals extra): the suffix baselines need it
import pytest
import vllm  # noqa: F401 - declared (cpu extra): the ngram baseline needs it

from evals.replay.drafters import make_drafter, schedule_lookup
from evals.measure.host_time import summarize
from evals.replay.projection import HostTime, StepCosts, break_even_host_ms
from evals.replay.engine import replay
from evals.replay.replay import main as replay_main
from evals.replay.bench import pick_schedule, schedule_from_ks
from evals.replay.report import targets
from evals.traces import Problem
from tests.evals_cli import STEP_COSTS, TRACES
from tests.evals_cli import synthetic_problems as synthetic_tuples


def synthetic_problems(n_problems=4, n_samples=6):
    return [Problem(*t) for t in synthetic_tuples(n_problems, n_samples)]


def repetitive_problems(n_problems=6, n_samples=6):
    """Paths that repeat themselves (ngram drafts) and their siblings (suffix drafts)."""
    problems = []
    for p in range(n_problems):
        unit = [30 + p, 31, 32, 33, 34, 35]
        comps = [unit * 4 + [40 + s % 3] + unit * 2 + [2] for s in range(n_samples)]
        problems.append(Problem(f"p{p}", [1000 + p] + list(range(10, 20)), comps))
    return problems


def run(method, problems, k=4, rows=8, **kw):
    max_len = max(len(p.prompt) + max(map(len, p.completions)) for p in problems) + k + 2
    drafter = make_drafter(method, k, max_len, rows, **kw)
    calls = []

    def spy(sampled, batch):
        drafts = drafter(sampled, batch)
        calls.append((len(sampled), [len(d) for d in drafts]))
        return drafts

    return replay(problems, spy, method, k, rows), calls


# --- schedule emulation -----------------------------------------------------


def test_schedule_lookup_is_vllms_with_k_capped_and_tail_carried():
    table = schedule_lookup([(1, 4, 8), (5, 6, 2), (9, 10, 0)], 12, 4)
    assert table[1:5] == [4, 4, 4, 4]        # 8 capped at num_speculative_tokens
    assert table[5:7] == [2, 2]
    assert table[7:9] == [2, 2]              # gap carries the previous k
    assert table[9:] == [0, 0, 0, 0]         # tail carries the last k


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_schedule_caps_each_steps_drafts_at_its_batch_sizes_k(method):
    problems = repetitive_problems()
    rows = 8
    # full batches (8 rows) draft at most 1; the tail (<= 5 rows) at most 3
    schedule = [(1, 5, 3), (6, 8, 1)]
    stats, calls = run(method, problems, k=4, rows=rows, schedule=schedule)
    full, tail = [c for c in calls if c[0] >= 6], [c for c in calls if c[0] <= 5]
    assert full and tail
    assert max(max(lens) for _, lens in full) <= 1
    assert max(max(lens) for _, lens in tail) <= 3
    assert max(max(lens) for _, lens in tail) > 1  # the tail really drafts longer
    unscheduled, _ = run(method, problems, k=4, rows=rows)
    assert stats.tokens == unscheduled.tokens
    assert stats.drafted < unscheduled.drafted


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_k0_schedule_equals_no_drafting(method):
    problems = repetitive_problems()
    off, calls = run(method, problems, schedule=[(1, 8, 0)])
    none, _ = run("none", problems)
    assert (off.tokens, off.row_steps, off.drafted, off.accepted) == \
        (none.tokens, none.row_steps, 0, 0)
    assert off.tau == 1.0
    assert calls  # vLLM still calls the proposer every step


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_full_k_schedule_is_vllms_unscheduled_proposer(method):
    problems = repetitive_problems()
    a, _ = run(method, problems, schedule=[(1, 8, 4)])
    b, _ = run(method, problems)
    assert b.drafted > 0
    assert (a.tokens, a.row_steps, a.drafted, a.accepted) == (b.tokens, b.row_steps, b.drafted, b.accepted)


def test_schedule_only_for_methods_vllm_passes_it_to():
    with pytest.raises(ValueError, match="ngram"):
        make_drafter("consensus", 4, 64, 8, schedule=[(1, 8, 2)])


def test_suffix_budget_reproduces_the_trace_and_learns_acceptance():
    problems = synthetic_problems(n_problems=6, n_samples=6)
    k, rows = 4, 8
    max_len = max(len(p.prompt) + max(map(len, p.completions)) for p in problems) + k + 2
    drafter = make_drafter("suffix-budget", k, max_len, rows)
    stats = replay(problems, drafter, "suffix-budget", k, rows)
    assert stats.tokens == sum(len(c) - 1 for p in problems for c in p.completions)
    assert stats.tau > 1.2
    assert drafter.num_drafted == stats.drafted
    assert 0 < drafter.num_accepted <= stats.accepted  # judged drafts only
    assert drafter.budget.calibrator._trials.sum() > drafter.budget.calibrator.prior * drafter.budget.calibrator.bins


def test_consensus_nobudget_turns_the_budget_off():
    assert make_drafter("consensus-nobudget", 4, 64, 8).proposer.budget is None
    assert make_drafter("consensus", 4, 64, 8).proposer.budget is not None


# --- sweep -------------------------------------------------------------------


def sweep_rows(table, params=None):
    return [{"batch": b, "k": k, "speedup": s, "params": params or {}}
            for b, by_k in table.items() for k, s in by_k.items()]


def test_sweep_picks_the_max_per_batch_size():
    rows = sweep_rows({16: {0: 0.99, 2: 1.5, 8: 1.9}, 64: {0: 0.98, 2: 1.2, 8: 1.1},
                       128: {0: 0.97, 2: 0.8, 8: 0.6}})
    pick = pick_schedule(rows)
    assert pick["k"] == {16: 8, 64: 2, 128: 0}
    assert pick["speedup"] == {16: 1.9, 64: 1.2, 128: 0.97}
    assert pick["schedule"] == [(1, 16, 8), (17, 64, 2), (65, 128, 0)]
    assert pick["text"] == "B16→k8, B64→k2, B128→off"
    # the schedule vLLM would build from it gives each measured batch size its k
    table = schedule_lookup(pick["schedule"], 256, 8)
    assert (table[16], table[64], table[128], table[256]) == (8, 2, 0, 0)


def test_sweep_ties_go_to_the_smaller_k_and_settings_are_chosen_engine_wide():
    assert pick_schedule(sweep_rows({16: {2: 1.5, 4: 1.5}}))["k"] == {16: 2}
    a = sweep_rows({16: {8: 2.0}, 128: {0: 0.9}}, {"p": 0.1})   # geometric mean 1.34
    b = sweep_rows({16: {8: 1.6}, 128: {2: 1.2}}, {"p": 0.3})   # geometric mean 1.39
    pick = pick_schedule(a + b)
    assert pick["params"] == {"p": 0.3} and pick["k"] == {16: 8, 128: 2}


def test_schedule_from_ks_sorts_batch_sizes():
    assert schedule_from_ks({64: 1, 16: 4}) == [(1, 16, 4), (17, 64, 1)]


# --- projections --------------------------------------------------------------


TINY = StepCosts([{"B": 16, "q": q, "ms": ms} for q, ms in ((1, 10.0), (2, 11.0), (3, 13.0))])


def test_async_aware_projection_arithmetic():
    # tau 2, d 1.5 -> T(16, 2.5) = 12; c = 100 µs x 16 rows = 1.6 ms; host 3 ms
    assert TINY.speedup(16, 2.0, 1.5, 100.0) == pytest.approx(2 * 10 / (12 + 1.6))
    assert TINY.speedup_async_aware(16, 2.0, 1.5, 100.0, 3.0) == pytest.approx(2 * 10 / (12 + 1.6 + 3))
    assert TINY.speedup_both_sync(16, 2.0, 1.5, 100.0, 3.0) == pytest.approx(2 * 13 / (12 + 1.6 + 3))
    # host time longer than the step: async no drafting is host-bound
    assert TINY.speedup_async_aware(16, 2.0, 1.5, 100.0, 20.0) == pytest.approx(2 * 20 / (12 + 1.6 + 20))
    # no host time: the two views agree
    assert TINY.speedup_async_aware(16, 2.0, 1.5, 100.0, 0.0) == pytest.approx(TINY.speedup(16, 2.0, 1.5, 100.0))


def test_break_even_host_time_makes_the_async_aware_speedup_one():
    h = break_even_host_ms(TINY, 16, 1.5, 1.5, 100.0)   # 1.5 * 10 - 12 - 1.6 = 1.4 ms
    assert h == pytest.approx(1.4)
    assert TINY.speedup_async_aware(16, 1.5, 1.5, 100.0, h) == pytest.approx(1.0)
    assert break_even_host_ms(TINY, 16, 1.1, 1.5, 100.0) < 0        # never pays
    assert break_even_host_ms(TINY, 16, 3.0, 1.5, 100.0) == float("inf")  # always pays


def test_host_time_table_loads_and_interpolates(tmp_path):
    path = tmp_path / "host.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"B": 64, "host_ms": 3.0, "host_wall_ms": 4.0}, {"B": 16, "host_ms": 1.0}, {"B": 128, "host_ms": 5.0}]) + "\n")
    host = HostTime.load(str(path))
    assert host.batch_sizes == [16, 64, 128]
    assert host.host_ms(64) == pytest.approx(3.0)
    assert host.host_ms(40) == pytest.approx(2.0)
    assert host.host_ms(8) == pytest.approx(1.0)      # below the table: its first value
    assert host.host_ms(192) == pytest.approx(7.0)    # above: along the last segment
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"B": 16}\n')
    with pytest.raises(ValueError, match="host_ms"):
        HostTime.load(str(bad))
    with pytest.raises(FileNotFoundError):
        HostTime.load(str(tmp_path / "missing.jsonl"))


def test_host_time_counts_only_pure_decode_steps_at_the_batch_size():
    steps = [
        {"rows": 4, "tokens": 40, "step_wall": 0.05, "step_cpu": 0.05, "device_wall": 0.04, "device_cpu": 0.04},
        {"rows": 4, "tokens": 4, "step_wall": 0.012, "step_cpu": 0.011, "device_wall": 0.010, "device_cpu": 0.010},
        {"rows": 4, "tokens": 4, "step_wall": 0.013, "step_cpu": 0.012, "device_wall": 0.010, "device_cpu": 0.010},
        {"rows": 4, "tokens": 4, "step_wall": 0.014, "step_cpu": 0.013, "device_wall": 0.010, "device_cpu": 0.010},
        {"rows": 3, "tokens": 3, "step_wall": 0.5, "step_cpu": 0.5, "device_wall": 0.0, "device_cpu": 0.0},
    ]
    row = summarize(steps, 4)
    assert row["steps"] == 3
    assert row["host_ms"] == pytest.approx(2.0)       # median of 1, 2, 3 ms (CPU)
    assert row["host_wall_ms"] == pytest.approx(3.0)  # median of 2, 3, 4 ms
    assert summarize(steps, 8) is None


def test_targets_are_checked_plainly():
    def r(method, speedup, aware, run=0):
        return {"traces": "t", "batch": 128, "scouts": 0, "method": method, "speedup": speedup,
                "speedup_async": aware, "run": run, "host_ms": 2.0, "break_even_host_ms": 1.0}
    lines = targets([r("none", 1.0, 1.0), r("suffix", 0.9, 0.7), r("consensus", 1.2, 0.95),
                     r("consensus", 1.08, 0.93, 1)])
    assert any("consensus ahead of every baseline" in x for x in lines)
    assert any("≥ 1.10 in every run: MISSED (1.08–1.20)" in x for x in lines)
    assert any("async-aware consensus ≥ 1.0 in every run: MISSED" in x for x in lines)


# --- end to end on the recorded fixture (tests/fixtures, see tests/test_replay.py) ----


def test_bench_sweeps_schedules_and_reports_both_views(tmp_path):
    host = tmp_path / "host.jsonl"
    host.write_text('{"B": 16, "host_ms": 1.0}\n{"B": 64, "host_ms": 2.0}\n')
    out = tmp_path / "r"
    code = replay_main(["--traces", TRACES, "--limit", "4", "--tune-limit", "2", "--costs", STEP_COSTS,
                        "--batches", "16", "64", "--sweep-k", "0", "4", "--repeats", "2",
                        "--repeat-batches", "64", "--host-time", str(host), "--out", str(out)])
    assert code == 0
    data = json.loads((tmp_path / "r.json").read_text())
    results = data["results"]
    assert {r["method"] for r in results} == {"none", "ngram", "suffix", "suffix-budget",
                                              "consensus-nobudget", "consensus"}
    assert len([r for r in results if r["method"] == "consensus" and r["batch"] == 64]) == 2
    for r in results:
        assert "speedup" in r and "speedup_async" in r
        if r["method"] != "none":  # host time below the step: drafting only loses by it
            assert r["speedup_async"] < r["speedup"]
    for method in ("ngram", "suffix"):
        pick = data["schedules"]["embedded_n8"][method]
        swept = {(s["batch"], s["k"]): s["speedup"] for s in data["sweep"] if s["method"] == method}
        for b in (16, 64):
            assert pick["speedup"][str(b)] == max(swept[(b, 0)], swept[(b, 4)])
        used = [r for r in results if r["method"] == method]
        assert all(r["schedule"] == [list(e) for e in pick["schedule"]] for r in used)
    md = (tmp_path / "r.md").read_text()
    assert "best schedule" in md and "async-unaware / async-aware" in md

    # the same results projected on another host-time table, nothing replayed
    slower = tmp_path / "slower.jsonl"
    slower.write_text('{"B": 16, "host_ms": 2.0}\n{"B": 64, "host_ms": 4.0}\n')
    assert replay_main(["--from-json", str(tmp_path / "r.json"), "--host-time", str(slower),
                        "--costs", STEP_COSTS, "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())["results"]
    assert len(again) == len(results)
    for old, new in zip(results, again):
        assert new["speedup"] == pytest.approx(old["speedup"])
        assert new["host_ms"] == 2 * old["host_ms"]
        if old["method"] != "none":
            assert new["speedup_async"] < old["speedup_async"]

    # what-if: a free drafter projects to tau T(B, 1) / T(B, 1 + d)
    assert replay_main(["--from-json", str(tmp_path / "r.json"), "--host-time", str(host),
                        "--costs", STEP_COSTS, "--drafter-time-scale", "0", "--out", str(tmp_path / "free")]) == 0
    assert "WHAT-IF" in (tmp_path / "free.md").read_text()
    costs = StepCosts.load(STEP_COSTS)
    for r in json.loads((tmp_path / "free.json").read_text())["results"]:
        if r["method"] != "none":
            b, d = r["batch"], r["drafts_per_step"]
            assert r["speedup"] == pytest.approx(r["tau"] * costs.step_ms(b, 1) / costs.step_ms(b, 1 + d))


def test_bench_missing_host_table_is_an_error(tmp_path, capsys):
    code = replay_main(["--traces", TRACES, "--limit", "2", "--methods", "none", "--costs", STEP_COSTS,
                        "--host-time", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "r")])
    assert code == 2
    assert "host-time table not found" in capsys.readouterr().err
