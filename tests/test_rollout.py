"""``python -m evals rollout`` as a user runs it (tests/evals_cli.py): a tiny
rollout batch on the embedded model, no drafting against consensus, the
table printed and every run's figures in the JSON."""

from __future__ import annotations

import json

from tests.evals_cli import ok, run_evals


def test_rollout_runs_and_prints_the_table(tmp_path):
    out = tmp_path / "rollout"
    stdout = ok(run_evals("rollout", "--prompts", "2", "--group", "3", "--max-tokens", "24",
                          "--methods", "none", "consensus", "--dtype", "float32",
                          "--max-model-len", "256", "--gpu-memory-utilization", "0.2", "--out", out,
                          env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}))
    assert "| method | makespan s (runs) | × none | tail s |" in stdout
    assert "| none |" in stdout and "| consensus |" in stdout
    data = json.loads((tmp_path / "rollout.json").read_text())
    rows = {r["method"]: r for r in data["results"]}
    assert set(rows) == {"none", "consensus"}
    for r in rows.values():
        assert r["rows"] == 6 and r["tokens"] == r["output_tokens"] > 0  # every token seen per step
        assert 0 <= r["tail_s"] <= r["makespan_s"] and r["cpu_s"] > 0
        assert r["tau_before_drain"] >= 1.0 and r["steps"] > 0
    assert rows["none"]["speculative_config"] is None
    assert rows["consensus"]["speculative_config"]["method"] == "custom_class"
    assert "num_drafted" in rows["consensus"]["proposer"]
    assert (tmp_path / "rollout.md").read_text().startswith("Rollout batch: 2 prompts x 3 samples")


def test_rollout_separate_requests_and_bad_arguments(tmp_path):
    out = tmp_path / "rollout"
    stdout = ok(run_evals("rollout", "--prompts", "2", "--group", "2", "--max-tokens", "12", "--requests",
                          "--methods", "none", "--dtype", "float32", "--max-model-len", "256",
                          "--gpu-memory-utilization", "0.2", "--out", out,
                          env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}))
    assert "separate requests" in stdout
    rows = json.loads((tmp_path / "rollout.json").read_text())["results"]
    assert rows[0]["rows"] == 4
    bad = run_evals("rollout", "--group", "0")
    assert bad.returncode == 2 and "must be >= 1" in bad.stderr


def test_replay_fixed_batch_admission(tmp_path):
    """``python -m evals replay --admission fixed``: the embedded fixture's 16
    problems x 8 paths as two batches of 64 rows, every path replayed whole,
    projected makespan and tail against no drafting."""
    from tests.evals_cli import EOS, STEP_COSTS, TRACES, read_json

    out = tmp_path / "fixed"
    stdout = ok(run_evals("replay", "--admission", "fixed", "--traces", TRACES, "--batches", "64",
                          "--methods", "none", "consensus", "--schedules", "fixed", "--costs", STEP_COSTS,
                          "--host-time", "none", "--out", out))
    assert "PROJECTED" in stdout and "2 batches of 8 prompts x 8 paths (64 rows)" in stdout
    rows = {r["method"]: r for r in read_json(str(out) + ".json")["results"]}
    paths = [c for line in open(TRACES) for c in json.loads(line)["completion_ids"]]
    recorded = sum(len(c) + (c[-1] != EOS) - 1 for c in paths)  # the loader ends each with EOS
    for r in rows.values():
        assert r["admission"] == "fixed" and r["batches"] == 2 and r["tokens"] == recorded
        assert 0 < r["tail_ms"] < r["makespan_ms"]
    assert rows["none"]["tau"] == 1.0 and rows["consensus"]["tau"] > 1.0
    bad = run_evals("replay", "--admission", "fixed", "--from-json", str(out) + ".json")
    assert bad.returncode == 2 and "no --from-json" in bad.stderr
