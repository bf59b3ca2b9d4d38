"""The replay benchmark as a user runs it, ``python -m evals replay`` (and
``python -m evals host-time --from-steps``), on trace files and tables the
tests write: vLLM's schedules emulated step by step (``--schedule``,
``--step-log``), the sweep's pick of a schedule (``--from-json --repick`` on
a saved sweep), the projections (``--from-json`` on hand-made results and a
small cost table), and the whole run on the recorded fixture."""

import json
from concurrent.futures import ThreadPoolExecutor

import arctic_inference  # noqa: F401 - declared (evals extra): the suffix baselines need it
import numpy as np
import pytest
import vllm  # noqa: F401 - declared (cpu extra): the ngram baseline needs it

from tests.evals_cli import STEP_COSTS, TRACES, ok, read_json, run_evals, synthetic_problems, write_traces


def repetitive_problems(n_problems=6, n_samples=6):
    """Paths that repeat themselves (ngram drafts) and their siblings (suffix drafts)."""
    problems = []
    for p in range(n_problems):
        unit = [30 + p, 31, 32, 33, 34, 35]
        comps = [unit * 4 + [40 + s % 3] + unit * 2 + [2] for s in range(n_samples)]
        problems.append((f"p{p}", [1000 + p] + list(range(10, 20)), comps))
    return problems


REP, SYN = repetitive_problems(), synthetic_problems(n_problems=6, n_samples=6)


def replay_args(*traces, methods, batches=(8,), k=4, extra=()):
    return ["replay", "--traces", *traces, "--methods", *methods, "--batches", *map(str, batches), "--k", str(k),
            "--schedules", "fixed", "--sweep-k", "0", "--online", "off", "--repeats", "1", "--costs", STEP_COSTS,
            "--host-time", "none", "--step-log", *extra]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    return tmp, write_traces(tmp / "rep.jsonl", REP), write_traces(tmp / "syn.jsonl", SYN)


@pytest.fixture(scope="module")
def unscheduled(traces):
    """Every method at k 4 everywhere on 8 rows: {(traces, method): result}."""
    tmp, rep, syn = traces
    ok(run_evals(*replay_args(rep, syn, methods=("none", "ngram", "suffix", "suffix-budget", "consensus-nobudget",
                                                 "consensus"), extra=("--out", tmp / "u"))))
    return {(r["traces"], r["method"]): r for r in read_json(tmp / "u.json")["results"]}


SCHEDULES = {"caps": ("1-5:3", "6-8:1"), "off": ("1-8:0",), "full": ("1-8:4",)}


@pytest.fixture(scope="module")
def scheduled(traces):
    """ngram and suffix on the repetitive set under each of SCHEDULES, and
    ngram at 12 rows under the lookup test's schedule: {name: {method: result}}.
    The four runs go side by side (each is mostly importing vLLM)."""
    tmp, rep, _ = traces
    runs = {name: replay_args(rep, methods=("ngram", "suffix"), extra=("--schedule", *spec, "--out", tmp / name))
            for name, spec in SCHEDULES.items()}
    runs["lookup"] = replay_args(rep, methods=("ngram",), batches=(12,), extra=(
        "--schedule", "1-4:8", "5-6:2", "9-10:0", "--out", tmp / "lookup"))
    with ThreadPoolExecutor(len(runs)) as pool:
        for out in pool.map(lambda args: run_evals(*args), runs.values()):
            ok(out)
    return {name: {r["method"]: r for r in read_json(tmp / f"{name}.json")["results"]} for name in runs}


def totals(r):
    return r["tokens"], r["row_steps"], r["drafted"], r["accepted"]


# --- schedule emulation -----------------------------------------------------


def test_schedule_lookup_is_vllms_with_k_capped_and_tail_carried(scheduled):
    r = scheduled["lookup"]["ngram"]
    table = r["k_by_rows"]                   # vLLM's own lookup at 0..12 rows, k 4
    assert table[1:5] == [4, 4, 4, 4]        # 8 capped at num_speculative_tokens
    assert table[5:7] == [2, 2]
    assert table[7:9] == [2, 2]              # gap carries the previous k
    assert table[9:] == [0, 0, 0, 0]         # tail carries the last k
    assert r["schedule"] == [[1, 4, 8], [5, 6, 2], [9, 10, 0]]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_schedule_caps_each_steps_drafts_at_its_batch_sizes_k(scheduled, unscheduled, method):
    # full batches (8 rows) draft at most 1; the tail (<= 5 rows) at most 3
    stats = scheduled["caps"][method]
    calls = stats["calls"]  # [rows, sorted distinct draft lengths] per drafter call
    full, tail = [c for c in calls if c[0] >= 6], [c for c in calls if c[0] <= 5]
    assert full and tail
    assert max(max(lens, default=0) for _, lens in full) <= 1
    assert max(max(lens, default=0) for _, lens in tail) <= 3
    assert max(max(lens, default=0) for _, lens in tail) > 1  # the tail really drafts longer
    plain = unscheduled[("rep", method)]
    assert stats["tokens"] == plain["tokens"]
    assert stats["drafted"] < plain["drafted"]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_k0_schedule_equals_no_drafting(scheduled, unscheduled, method):
    off = scheduled["off"][method]
    none = unscheduled[("rep", "none")]
    assert totals(off) == (none["tokens"], none["row_steps"], 0, 0)
    assert off["tau"] == 1.0
    assert off["calls"]  # vLLM still calls the proposer every step


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_full_k_schedule_is_vllms_unscheduled_proposer(scheduled, unscheduled, method):
    a, b = scheduled["full"][method], unscheduled[("rep", method)]
    assert b["drafted"] > 0
    assert totals(a) == totals(b)


def test_schedule_only_for_methods_vllm_passes_it_to(traces):
    tmp, rep, _ = traces
    out = run_evals(*replay_args(rep, methods=("consensus",), extra=("--schedule", "1-8:2", "--out", tmp / "x")))
    assert out.returncode == 2
    assert "ngram" in out.stderr and "'consensus'" in out.stderr and "Traceback" not in out.stderr


def test_suffix_budget_reproduces_the_trace_and_learns_acceptance(unscheduled):
    stats = unscheduled[("syn", "suffix-budget")]
    budget = stats["budget"]
    assert stats["tokens"] == sum(len(c) - 1 for _, _, comps in SYN for c in comps)
    assert stats["tau"] > 1.2
    assert budget["drafted"] == stats["drafted"]
    assert 0 < budget["accepted_judged"] <= stats["accepted"]  # judged drafts only
    assert budget["calibration_trials"] > budget["calibration_prior_trials"]


def test_consensus_nobudget_turns_the_budget_off(unscheduled):
    assert unscheduled[("syn", "consensus-nobudget")]["budget"] == {"on": False}
    assert unscheduled[("syn", "consensus")]["budget"] == {"on": True}


# --- sweep -------------------------------------------------------------------
# Saved sweeps re-picked on a flat cost table with no drafter time, where each
# projected speedup is the row's tau: the table below is the speedups.


def sweep_rows(name, table, params=None):
    return [{"traces": name, "method": "ngram", "problems": 1, "scouts": 0, "run": 0, "batch": b, "k": k,
             "tau": s, "drafts_per_step": 1.0, "cpu_us_per_row": 0.0, "params": params or {}, "sweep": True}
            for b, by_k in table.items() for k, s in by_k.items()]


@pytest.fixture(scope="module")
def picks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    flat = tmp / "flat.jsonl"
    flat.write_text("".join(json.dumps({"B": b, "q": q, "ms": 10.0}) + "\n" for b in (16, 64, 128) for q in (1, 9)))
    sweep = (sweep_rows("max", {16: {0: 0.99, 2: 1.5, 8: 1.9}, 64: {0: 0.98, 2: 1.2, 8: 1.1},
                                128: {0: 0.97, 2: 0.8, 8: 0.6}})
             + sweep_rows("ties", {16: {2: 1.5, 4: 1.5}})
             + sweep_rows("wide", {16: {8: 2.0}, 128: {0: 0.9}}, {"p": 0.1})   # geometric mean 1.34
             + sweep_rows("wide", {16: {8: 1.6}, 128: {2: 1.2}}, {"p": 0.3})   # geometric mean 1.39
             + sweep_rows("order", {64: {1: 1.0}, 16: {4: 1.0}}))
    saved = tmp / "saved.json"
    saved.write_text(json.dumps({"results": [], "sweep": sweep}))
    ok(run_evals("replay", "--from-json", saved, "--repick", "--costs", flat, "--host-time", "none",
                 "--out", tmp / "p"))
    return {name: by_method["ngram"] for name, by_method in read_json(tmp / "p.json")["schedules"].items()}


def test_sweep_picks_the_max_per_batch_size(picks):
    pick = picks["max"]
    assert pick["k"] == {"16": 8, "64": 2, "128": 0}
    assert pick["speedup"] == {"16": 1.9, "64": 1.2, "128": 0.97}
    # the schedule vLLM builds from it gives each measured batch size its k (vLLM's lookup
    # of a schedule, gaps and tail carried: test_schedule_lookup_is_vllms...)
    assert pick["schedule"] == [[1, 16, 8], [17, 64, 2], [65, 128, 0]]
    assert pick["text"] == "B16→k8, B64→k2, B128→off"


def test_sweep_ties_go_to_the_smaller_k_and_settings_are_chosen_engine_wide(picks):
    assert picks["ties"]["k"] == {"16": 2}
    assert picks["wide"]["params"] == {"p": 0.3} and picks["wide"]["k"] == {"16": 8, "128": 2}


def test_schedule_from_ks_sorts_batch_sizes(picks):
    assert picks["order"]["schedule"] == [[1, 16, 4], [17, 64, 1]]


# --- projections --------------------------------------------------------------
# Hand-made results projected afresh (--from-json): TINY's T(B, q) at every
# batch size (q 1, 2, 3: 10, 11, 13 ms), so each row's batch size picks its
# host time; cpu_us_per_row is set so the drafter costs c = 1.6 ms a step.

TINY_Q = ((1, 10.0), (2, 11.0), (3, 13.0))
HOST = {16: 3.0, 32: 20.0, 48: 0.0, 64: 1.4}


def result(name, batch, tau, method="consensus", d=1.5, c_ms=1.6, run=0):
    return {"traces": name, "problems": 1, "scouts": 0, "run": run, "method": method, "batch": batch,
            "tau": tau, "drafts_per_step": d, "cpu_us_per_row": c_ms * 1000.0 / batch}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def project(tmp, results, costs, host, *extra):
    saved = tmp / "saved.json"
    saved.write_text(json.dumps({"results": results}))
    out = ok(run_evals("replay", "--from-json", saved, "--costs", costs, "--host-time", host, *extra,
                       "--out", tmp / "p"))
    return {r["traces"] + (f"/{r['run']}" if r["run"] else ""): r for r in read_json(tmp / "p.json")["results"]}, out


@pytest.fixture(scope="module")
def projected(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("proj")
    costs = write_jsonl(tmp / "tiny.jsonl", [{"B": b, "q": q, "ms": ms} for b in HOST for q, ms in TINY_Q]
                        + [{"B": 128, "q": q, "ms": 10.0} for q in (1, 9)])  # flat at 128: speedup = tau
    host = write_jsonl(tmp / "host.jsonl", [{"B": b, "host_ms": h} for b, h in {**HOST, 128: 2.0}.items()])
    results = [result("at16", 16, 2.0), result("at32", 32, 2.0), result("at48", 48, 2.0),
               result("even16", 16, 1.5), result("even64", 64, 1.5), result("never", 16, 1.1),
               result("always", 16, 3.0)]
    # targets: worst consensus 1.08 > best other (suffix 0.9) and > 1; async-aware tau x 10 / 12
    targets = [result("t", 128, tau, method, c_ms=0.0, run=run)
               for method, tau, run in (("none", 1.0, 0), ("suffix", 0.9, 0), ("consensus", 1.2, 0),
                                        ("consensus", 1.08, 1))]
    return project(tmp, results + targets, costs, host)


def test_async_aware_projection_arithmetic(projected):
    rows = projected[0]
    # tau 2, d 1.5 -> T(16, 2.5) = 12; c = 100 µs x 16 rows = 1.6 ms; host 3 ms
    at16 = rows["at16"]
    assert at16["speedup"] == pytest.approx(2 * 10 / (12 + 1.6))
    assert at16["host_ms"] == 3.0
    assert at16["speedup_async"] == pytest.approx(2 * 10 / (12 + 1.6 + 3))
    assert at16["speedup_both_sync"] == pytest.approx(2 * 13 / (12 + 1.6 + 3))
    # host time longer than the step: async no drafting is host-bound
    assert rows["at32"]["speedup_async"] == pytest.approx(2 * 20 / (12 + 1.6 + 20))
    # no host time: the two views agree
    assert rows["at48"]["host_ms"] == 0.0
    assert rows["at48"]["speedup_async"] == pytest.approx(rows["at48"]["speedup"])
    assert rows["at48"]["speedup"] == pytest.approx(at16["speedup"])


def test_break_even_host_time_makes_the_async_aware_speedup_one(projected):
    rows = projected[0]
    h = rows["even16"]["break_even_host_ms"]   # 1.5 * 10 - 12 - 1.6 = 1.4 ms
    assert h == pytest.approx(1.4)
    assert rows["even64"]["break_even_host_ms"] == pytest.approx(1.4)
    assert rows["even64"]["host_ms"] == pytest.approx(h)  # the same row at that host time
    assert rows["even64"]["speedup_async"] == pytest.approx(1.0)
    assert rows["never"]["break_even_host_ms"] < 0                 # never pays
    assert rows["always"]["break_even_host_ms"] == float("inf")    # always pays


def test_targets_are_checked_plainly(projected):
    rows, out = projected
    assert rows["t/1"]["speedup"] == pytest.approx(1.08) and rows["t"]["host_ms"] == 2.0
    lines = out.split("\nTargets:\n")[1].splitlines()
    assert any("consensus ahead of every baseline" in x for x in lines)
    assert any("≥ 1.2 in every run: MISSED (1.08–1.20)" in x for x in lines)
    assert any("async-aware consensus ≥ 1.0 in every run: MISSED" in x for x in lines)
    assert any("break-even hidden host time ≥ 2 ms in every run: " in x for x in lines)


def test_host_time_table_loads_and_interpolates(tmp_path):
    costs = write_jsonl(tmp_path / "costs.jsonl", [{"B": b, "q": q, "ms": ms} for b in (8, 40, 64, 192)
                                                   for q, ms in TINY_Q])
    host = write_jsonl(tmp_path / "host.jsonl", [  # out of order, with an extra column
        {"B": 64, "host_ms": 3.0, "host_wall_ms": 4.0}, {"B": 16, "host_ms": 1.0}, {"B": 128, "host_ms": 5.0}])
    rows, _ = project(tmp_path, [result(f"b{b}", b, 2.0) for b in (8, 40, 64, 192)], costs, host)
    assert rows["b64"]["host_ms"] == pytest.approx(3.0)
    assert rows["b40"]["host_ms"] == pytest.approx(2.0)
    assert rows["b8"]["host_ms"] == pytest.approx(1.0)      # below the table: its first value
    assert rows["b192"]["host_ms"] == pytest.approx(7.0)    # above: along the last segment
    saved = tmp_path / "saved.json"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"B": 16}\n')
    out = run_evals("replay", "--from-json", saved, "--costs", costs, "--host-time", bad, "--out", tmp_path / "q")
    assert out.returncode == 2 and "host_ms" in out.stderr and "Traceback" not in out.stderr
    out = run_evals("replay", "--from-json", saved, "--costs", costs, "--host-time", tmp_path / "missing.jsonl",
                    "--out", tmp_path / "q")
    assert out.returncode == 2 and "not found" in out.stderr and "Traceback" not in out.stderr


def test_host_time_counts_only_pure_decode_steps_at_the_batch_size(tmp_path):
    steps = write_jsonl(tmp_path / "steps.jsonl", [
        {"rows": 4, "tokens": 40, "step_wall": 0.05, "step_cpu": 0.05, "device_wall": 0.04, "device_cpu": 0.04},
        {"rows": 4, "tokens": 4, "step_wall": 0.012, "step_cpu": 0.011, "device_wall": 0.010, "device_cpu": 0.010},
        {"rows": 4, "tokens": 4, "step_wall": 0.013, "step_cpu": 0.012, "device_wall": 0.010, "device_cpu": 0.010},
        {"rows": 4, "tokens": 4, "step_wall": 0.014, "step_cpu": 0.013, "device_wall": 0.010, "device_cpu": 0.010},
        {"rows": 3, "tokens": 3, "step_wall": 0.5, "step_cpu": 0.5, "device_wall": 0.0, "device_cpu": 0.0},
    ])
    out = run_evals("host-time", "--from-steps", steps, "--batches", "4", "8", "--out", tmp_path / "host.jsonl")
    ok(out)
    (row,) = [json.loads(line) for line in (tmp_path / "host.jsonl").read_text().splitlines()]
    assert row["B"] == 4 and row["steps"] == 3
    assert row["host_ms"] == pytest.approx(2.0)       # median of 1, 2, 3 ms (CPU)
    assert row["host_wall_ms"] == pytest.approx(3.0)  # median of 2, 3, 4 ms
    assert "B=8: no pure decode step" in out.stderr   # no step at 8 rows: no row


# --- end to end on the recorded fixture (tests/fixtures, see tests/test_replay.py) ----


def step_ms(batch, q):
    """T(B, q) of the fixture cost table, linear in q (what the projection reads)."""
    rows = sorted((r["q"], r["ms"]) for r in map(json.loads, open(STEP_COSTS)) if r["B"] == batch)
    return float(np.interp(q, [x for x, _ in rows], [m for _, m in rows]))


def test_bench_sweeps_schedules_and_reports_both_views(tmp_path):
    host = tmp_path / "host.jsonl"
    host.write_text('{"B": 16, "host_ms": 1.0}\n{"B": 64, "host_ms": 2.0}\n')
    out = tmp_path / "r"
    ok(run_evals("replay", "--traces", TRACES, "--limit", "4", "--tune-limit", "2", "--costs", STEP_COSTS,
                 "--batches", "16", "64", "--sweep-k", "0", "4", "--repeats", "2",
                 "--repeat-batches", "64", "--host-time", host, "--out", out))
    data = json.loads((tmp_path / "r.json").read_text())
    results = data["results"]
    assert {r["method"] for r in results} == {"none", "ngram", "suffix", "suffix-budget",
                                              "consensus-nobudget", "consensus"}
    assert len([r for r in results if r["method"] == "consensus" and r["batch"] == 64]) == 2
    none_ms = {r["batch"]: r["run_ms"] for r in results if r["method"] == "none"}
    for r in results:
        assert "speedup" in r and "speedup_async" in r
        # the whole run projected step by step, against no drafting's at the same batch size
        assert r["run_ms"] > 0
        assert r["run_speedup"] == pytest.approx(none_ms[r["batch"]] / r["run_ms"])
        steady = r["steady"]
        assert steady["steps"] >= 0 and (steady["steps"] == 0 or steady["tau"] >= 1.0)
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
    ok(run_evals("replay", "--from-json", tmp_path / "r.json", "--host-time", slower,
                 "--costs", STEP_COSTS, "--out", tmp_path / "again"))
    again = json.loads((tmp_path / "again.json").read_text())["results"]
    assert len(again) == len(results)
    for old, new in zip(results, again):
        assert new["speedup"] == pytest.approx(old["speedup"])
        assert new["host_ms"] == 2 * old["host_ms"]
        if old["method"] != "none":
            assert new["speedup_async"] < old["speedup_async"]

    # what-if: a free drafter projects to tau T(B, 1) / T(B, 1 + d)
    ok(run_evals("replay", "--from-json", tmp_path / "r.json", "--host-time", host,
                 "--costs", STEP_COSTS, "--drafter-time-scale", "0", "--out", tmp_path / "free"))
    assert "WHAT-IF" in (tmp_path / "free.md").read_text()
    for r in json.loads((tmp_path / "free.json").read_text())["results"]:
        if r["method"] != "none":
            seen = r["steady"] if r["projected_over"] == "steady steps" else r
            b, d = r["batch"], seen["drafts_per_step"]
            assert r["speedup"] == pytest.approx(seen["tau"] * step_ms(b, 1) / step_ms(b, 1 + d))


def test_bench_missing_host_table_is_an_error(tmp_path):
    out = run_evals("replay", "--traces", TRACES, "--limit", "2", "--methods", "none", "--costs", STEP_COSTS,
                    "--host-time", tmp_path / "nope.jsonl", "--out", tmp_path / "r")
    assert out.returncode == 2
    assert "host-time table not found" in out.stderr
