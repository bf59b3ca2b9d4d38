"""The device-route emulation's replay (``python -m evals replay --methods
device-emul-lag*``; ``device-lag*``, the speculator itself, is in
tests/test_device_speculator.py):
sibling tokens reach the tries ``lag`` calls late, and every draft is
exactly K tokens (or none at K = 0); ``python -m evals device-report`` tables
a replay's results.

Not kept from the in-process tests: driving the drafter call by call (two
hand-written rows) to pin the exact call a sibling's token becomes draftable
at; the command line replays whole traces only."""

import json

import pytest

from tests.evals_cli import STEP_COSTS, ok, read_json, recorded_tokens, run_evals, write_traces


def problems(n_problems=3, n_samples=5):
    out = []
    for p in range(n_problems):
        base = [30 + p, 31, 32, 33, 34, 35, 36, 37]
        comps = [base + ([40, 41] if s % 2 else [50, 51, 52]) + base[:4] + [2] for s in range(n_samples)]
        out.append((f"p{p}", [1000 + p] + list(range(10, 20)), comps))
    return out


def replay(tmp, name, probs, methods, rows, k, *extra):
    traces = write_traces(tmp / f"{name}.jsonl", probs)
    ok(run_evals("replay", "--traces", traces, "--methods", *methods, "--batches", rows, "--k", k,
                 "--sweep-k", "0", "--schedules", "fixed", "--repeats", "1", "--costs", STEP_COSTS,
                 "--host-time", "none", "--step-log", *extra, "--out", tmp / name))
    return {r["method"]: r for r in read_json(tmp / f"{name}.json")["results"]}


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory):
    # full batches: off; the tail (<= 3 rows): K = 3
    return replay(tmp_path_factory.mktemp("dev"), "sched", problems(),
                  ("device-emul-lag1", "device-emul-lag2"), 6, 4,
                  "--schedule", "1-3:3", "4-6:0")


@pytest.fixture(scope="module")
def lags(tmp_path_factory):
    return replay(tmp_path_factory.mktemp("dev"), "lags", problems(n_problems=4, n_samples=8),
                  ("device-emul-lag0", "device-emul-lag1", "device-emul-lag2"), 8, 3)


@pytest.mark.parametrize("method", ["device-emul-lag1", "device-emul-lag2"])
def test_drafts_are_exactly_k_or_zero_and_follow_the_schedule(scheduled, method):
    probs = problems()
    stats = scheduled[method]
    lengths = []
    for rows, lens in stats["calls"]:
        want = 3 if rows <= 3 else 0
        lengths.append(set(lens))
        assert lens == [want], (rows, lens)
    assert {0} in lengths and {3} in lengths
    assert stats["tokens"] == recorded_tokens(probs)  # every recorded token, first ones aside
    assert stats["drafted"] == 3 * sum(n for n, d in stats["steps"] if d)


def test_every_lag_drafts_and_route_stats_count_the_table(lags):
    k = 3
    for lag in (0, 1, 2):
        s = lags[f"device-emul-lag{lag}"]
        assert s["tau"] > 1.0 and s["drafted"] == k * s["row_steps"]
        assert all(lens == [k] for _, lens in s["calls"])  # no schedule: always K tokens
        assert s["lag"] == lag and 0.0 < s["hit_rate"] <= 1.0
        assert s["table_entries"] > 0 and s["refresh_full_bytes"] == pytest.approx(
            s["table_entries"] * (8 + 4 * k))
        assert 0 < s["refresh_delta_bytes"] <= s["refresh_full_bytes"]


def test_table_bolds_the_view_each_route_runs_under(tmp_path):
    base = {"traces": "addsub_x", "batch": 128, "tau": 2.0, "drafts_per_step": 2.0}
    results = [{**base, "method": "consensus", "speedup": 1.2, "speedup_async": 0.9},
               {**base, "method": "device-lag1", "k_at_batch": 2, "speedup": 1.1, "speedup_async": 1.0,
                "lag": 1, "hit_rate": 0.5, "table_entries": 4000.0, "refresh_full_bytes": 64000.0,
                "changed_contexts": 20.0, "refresh_delta_bytes": 320.0, "host_feed_us_per_call": 200.0}]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"results": results}))
    lines = ok(run_evals("device-report", path, "--costs", STEP_COSTS)).splitlines()
    assert "| 1.20 | **0.90** |" in lines[2] and "per row" in lines[2]
    assert "| **1.10** | 1.00 |" in lines[3] and "| 2 |" in lines[3]
    # the second table: the device table's size and refresh against the lag's budget
    assert any(line.startswith("| addsub | 128 | 1 | 2 | 0.50 | 4k | 0.06 MB |") for line in lines)
