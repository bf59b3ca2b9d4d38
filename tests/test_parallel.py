"""Consensus drafting under vLLM's data and tensor parallelism (CPU build).

* DP=2 OpenAI server: without the ``X-data-parallel-rank`` header vLLM splits
  the children of an n = 8 request over both engines; with
  ``consensus_spec.sampling.routing.rank_headers`` every child runs, and is drafted
  for, on the prompt's engine, and the engines' proposers hold one sibling
  group per prompt between them.
* TP=2 ``LLM``: greedy outputs with consensus drafting equal those without
  speculation, and every TP rank built a proposer that drafted.

The engines run in subprocesses (tests/parallel_run.py), in their own
process groups, all stopped before each test returns. An engine that does
not start fails the test, unless vLLM says the platform lacks the feature
(its error is a ``NotImplementedError`` or says "not supported", and no
traceback passes through this project's code): then the test skips with
vLLM's own message, a reason tests/allowed_skips.txt allows.
"""

import glob
import os
import re

import pytest
import vllm  # noqa: F401 - declared (cpu extra): a missing one fails, never skips

from tests.parallel_run import ParallelUnavailable, check_dp, run_dp, run_tp  # noqa: E402

# vLLM's words for a platform without the feature; any other start failure fails
LACKS_FEATURE = re.compile(r"^.*(?:NotImplementedError|\bnot (?:yet )?supported\b|\b[Uu]nsupported\b).*$",
                           re.M)
OWN_FRAME = re.compile(r'File "[^"]*/(?:consensus_spec|tests)/')  # a traceback through this project


def skip_if_platform_lacks(e: ParallelUnavailable, what: str, log_dir) -> None:
    """Skip with vLLM's message where it says the platform lacks ``what``; fail otherwise."""
    logs = ""
    for path in sorted(glob.glob(os.path.join(str(log_dir), "*.log"))):
        with open(path, errors="replace") as f:
            logs += f.read()
    lacks = LACKS_FEATURE.search(str(e))
    if lacks and not OWN_FRAME.search(logs):
        pytest.skip(f"vLLM on this platform lacks {what}: {lacks.group(0).strip()}")
    pytest.fail(f"{what}: the engine did not start (not a platform limit vLLM reports):\n{e}",
                pytrace=False)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


needs_two_cores = pytest.mark.skipif(_cores() < 2, reason="DP=2 / TP=2 on CPU bind one core per rank")


@pytest.mark.slow
@needs_two_cores
def test_dp_header_keeps_every_sibling_on_one_engine(tmp_path):
    try:
        result = run_dp(num_prompts=3, n=8, dp=2, log_dir=str(tmp_path))
    except ParallelUnavailable as e:
        skip_if_platform_lacks(e, "--data-parallel-size 2", tmp_path)
    assert check_dp(result) == []
    # the problem the header solves: by default each request's children are split
    for req in result["phases"]["default"]["requests"]:
        assert sum(1 for row in req["per_engine"].values() if row["requests"]) == 2, req
    default = result["phases"]["default"]["proposer"]
    assert sum(c["num_groups"] for c in default.values()) == 2 * len(result["phases"]["default"]["requests"])
    pinned = result["phases"]["pinned"]["proposer"]
    assert sum(c["paths_started"] for c in pinned.values()) >= 8 * 3  # a preempted path restarts


@pytest.mark.slow
@needs_two_cores
def test_tp2_consensus_drafting_is_lossless(tmp_path):
    try:
        result = run_tp(num_prompts=20, log_dir=str(tmp_path))
    except ParallelUnavailable as e:
        skip_if_platform_lacks(e, "tensor_parallel_size=2", tmp_path)
    assert result["identical"], f"requests {result['differing']} differ"
    assert result["spec_metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0
    ranks = result["ranks"]
    assert sorted(r["tp_rank"] for r in ranks) == [0, 1]
    assert all(r["proposer"] == "ConsensusProposer" and r["counters"]["num_drafted"] > 0 for r in ranks)


def test_only_platform_limits_vllm_reports_skip(tmp_path):
    """How a start failure is judged (no engine: the messages are made up)."""
    lacks = ParallelUnavailable("server exited with 1:\nNotImplementedError: Multi-node DP is not "
                                "supported on CPU")
    with pytest.raises(pytest.skip.Exception, match="lacks --data-parallel-size 2: NotImplementedError"):
        skip_if_platform_lacks(lacks, "--data-parallel-size 2", tmp_path)
    crash = ParallelUnavailable("server exited with 1:\nValueError: bad proposer option")
    with pytest.raises(pytest.fail.Exception, match="bad proposer option"):
        skip_if_platform_lacks(crash, "--data-parallel-size 2", tmp_path)
    (tmp_path / "server.log").write_text(
        'Traceback (most recent call last):\n  File "/x/consensus_spec/vllm/proposer.py", line 1\n'
        "NotImplementedError: not supported\n")
    with pytest.raises(pytest.fail.Exception):  # raised through this project's code: ours
        skip_if_platform_lacks(lacks, "--data-parallel-size 2", tmp_path)
