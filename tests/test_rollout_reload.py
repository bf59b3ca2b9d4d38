"""Two rollout batches in one LLM with a weight reload between them
(tests/rollout_reload.py, in its own process): greedy outputs equal with
consensus drafting and without, in both batches; the reload changed them;
memory after the second batch within 5% of after the first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_batches_with_a_weight_reload_between_them(tmp_path):
    out = tmp_path / "reload.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run([sys.executable, "-m", "tests.rollout_reload", str(out), "greedy"], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    plain, spec = json.loads(out.read_text())
    assert plain["reloaded_tensors"] == spec["reloaded_tensors"] > 0
    for b in range(2):  # lossless in each batch, across the reload
        assert spec["batches"][b]["token_ids"] == plain["batches"][b]["token_ids"]
    assert plain["batches"][0]["token_ids"] != plain["batches"][1]["token_ids"]  # the weights moved
    assert spec["batches"][0]["drafted"] > 0
    first, second = spec["batches"][0], spec["batches"][1]
    assert abs(second["rss_bytes"] / first["rss_bytes"] - 1) <= 0.05
    assert second["proposer"]["arena_bytes"] == first["proposer"]["arena_bytes"]  # allocated once
    assert second["proposer"]["live_groups"] == first["proposer"]["live_groups"]  # same prompts, same groups
    assert second["proposer"]["live_paths"] <= second["proposer"]["path_slots"]
