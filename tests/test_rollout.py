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
