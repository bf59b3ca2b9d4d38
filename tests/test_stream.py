"""``python -m evals stream``: one proposer fed pass after pass of traces,
its arena rotating many times. Sizes are tiny so the halves turn over."""

import json

from tests.evals_cli import TRACES, ok, run_evals


def test_stream_rotates_the_arena_without_reallocating_and_reports_each_call(tmp_path):
    out = tmp_path / "stream.json"
    text = ok(run_evals("stream", "--traces", TRACES, "--tokens", 60_000, "--window", 20_000,
                        "--rows", 16, "--max-trie-nodes", 20_000, "--out", out))
    s = json.loads(out.read_text())["summary"]
    assert s["tokens"] >= 60_000 and s["passes"] > 1
    assert s["evictions"] >= 2 and s["arena_reallocations"] == 0
    # the drafter times its own rotations: a mean no longer than the longest
    assert 0 < s["eviction_ms_mean"] <= s["eviction_ms_max"] and s["eviction_cpu_ms_mean"] > 0
    assert s["peak_nodes"] <= 20_000 and s["failed_steps"] == 0 and s["check_passed"]
    assert s["propose_calls"] > 1000
    assert 0 < s["propose_cpu_ms_p50"] <= s["propose_cpu_ms_p999"] <= s["propose_cpu_ms_max"]
    assert "propose() per call" in text
