"""consensus_spec.sampling.routing: stable DP ranks that keep a prompt's siblings on
one engine; the DP replay's routings; and, where vLLM is installed, that
vLLM's own front end honours the rank for every child of an n > 1 request."""

import collections
import os
import subprocess
import sys
from copy import copy
from types import SimpleNamespace

import numpy as np
import pytest

from consensus_spec.sampling.routing import (
    DP_RANK_HEADER,
    data_parallel_rank,
    engine_data_parallel_size,
    prompt_bytes,
    rank_headers,
    request_pinning,
    shard,
)
from tests.evals_cli import TRACES, ok, read_json, recorded_tokens, run_evals, write_traces

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [f"Question: problem {i}\nAnswer:" for i in range(200)]


def test_rank_is_in_range_and_deterministic():
    for size in (1, 2, 3, 8, 64):
        ranks = [data_parallel_rank(p, size) for p in PROMPTS]
        assert all(0 <= r < size for r in ranks)
        assert ranks == [data_parallel_rank(p, size) for p in PROMPTS]
    assert {data_parallel_rank(p, 1) for p in PROMPTS} == {0}


def test_golden_ranks_do_not_change():
    """Changing these moves every user's prompts to other engines (their
    prefix caches go cold): only on purpose."""
    assert [data_parallel_rank(f"q{i}", 8) for i in range(8)] == [2, 1, 6, 7, 7, 4, 2, 4]
    assert data_parallel_rank("hello", 8) == 5
    assert data_parallel_rank([1, 2, 3], 8) == 5


def test_stable_across_processes_and_hash_seeds():
    code = ("from consensus_spec.sampling.routing import data_parallel_rank as r;"
            "print([r(f'Question: problem {i}', 8) for i in range(50)], r([5, 6, 7], 3))")
    outs = set()
    for seed in ("0", "123", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                                capture_output=True, text=True).stdout)
    assert len(outs) == 1
    here = str([data_parallel_rank(f"Question: problem {i}", 8) for i in range(50)])
    assert outs.pop().startswith(here)


def test_prompt_forms():
    ids = [17, 4, 99, 100000]
    r = data_parallel_rank(ids, 8)
    assert data_parallel_rank(tuple(ids), 8) == r
    assert data_parallel_rank(np.array(ids, dtype=np.int32), 8) == r
    assert data_parallel_rank([np.int64(t) for t in ids], 8) == r
    assert data_parallel_rank({"prompt_token_ids": ids}, 8) == r
    assert data_parallel_rank({"prompt": "abc"}, 8) == data_parallel_rank("abc", 8)
    # token ids hash the way the drafter keys its groups (int64)
    assert prompt_bytes(ids)[1:] == np.asarray(ids, dtype="<i8").tobytes()
    msgs = [{"role": "user", "content": "hi"}]
    assert data_parallel_rank(msgs, 8) == data_parallel_rank([{"content": "hi", "role": "user"}], 8)
    assert prompt_bytes("7") != prompt_bytes([7]) != prompt_bytes(b"7")


@pytest.mark.parametrize("bad", [None, 3, 2.5, [1.0, 2.0], [True], {"x": 1}, [[1, 2]], object()])
def test_bad_prompts_are_type_errors(bad):
    with pytest.raises(TypeError):
        data_parallel_rank(bad, 2)
    with pytest.raises(TypeError):
        data_parallel_rank(bad, 1)


@pytest.mark.parametrize("size, error", [(0, ValueError), (-2, ValueError), (2.0, TypeError),
                                         (True, TypeError), ("2", TypeError), (None, TypeError)])
def test_bad_sizes(size, error):
    with pytest.raises(error, match="data_parallel_size"):
        data_parallel_rank("p", size)
    with pytest.raises(error, match="data_parallel_size"):
        rank_headers("p", size)
    with pytest.raises(error, match="data_parallel_size"):
        shard(["p"], 0, size)


def test_spread_is_even():
    prompts = [f"prompt number {i}" for i in range(16000)]
    for size in (2, 8):
        counts = collections.Counter(data_parallel_rank(p, size) for p in prompts)
        assert sorted(counts) == list(range(size))
        expected = len(prompts) / size
        assert max(abs(c - expected) for c in counts.values()) < 0.06 * expected


def test_growing_the_pool_moves_few_prompts():
    prompts = [f"prompt number {i}" for i in range(8000)]
    for size in (2, 8):
        moved = sum(data_parallel_rank(p, size) != data_parallel_rank(p, size + 1) for p in prompts)
        assert moved / len(prompts) == pytest.approx(1 / (size + 1), abs=0.03)
        # a moved prompt goes to the new engine, never between old ones
        assert all(data_parallel_rank(p, size + 1) == size for p in prompts
                   if data_parallel_rank(p, size) != data_parallel_rank(p, size + 1))


def test_rank_headers():
    h = rank_headers("some prompt", 4)
    assert list(h) == [DP_RANK_HEADER] and h[DP_RANK_HEADER] == str(data_parallel_rank("some prompt", 4))
    assert rank_headers("some prompt", 1) == {}
    with pytest.raises(TypeError):
        rank_headers(None, 1)


def test_shard_partitions_by_rank():
    problems = [{"q": p} for p in PROMPTS]
    parts = [shard(problems, r, 3, key=lambda x: x["q"]) for r in range(3)]
    assert sorted(i for part in parts for i in part) == list(range(len(problems)))
    assert all(data_parallel_rank(PROMPTS[i], 3) == r for r, part in enumerate(parts) for i in part)
    assert shard(PROMPTS, 0, 1) == list(range(len(PROMPTS)))
    for rank in (-1, 3, True, 1.0):
        with pytest.raises(ValueError, match="rank"):
            shard(PROMPTS, rank, 3)


def _config(dp, backend="mp"):
    return SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=dp,
                                                           distributed_executor_backend=backend))


def test_engine_data_parallel_size():
    assert engine_data_parallel_size(_config(4)) == 4
    assert engine_data_parallel_size(SimpleNamespace(vllm_config=_config(2))) == 2
    assert engine_data_parallel_size(SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=_config(2)))) == 2
    assert engine_data_parallel_size(object()) == 1
    assert engine_data_parallel_size(SimpleNamespace(vllm_config=_config(0))) == 1


class _Sync:  # LLMEngine.add_request as in vLLM 0.32: no rank argument
    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0):
        pass


class _Async:  # AsyncLLM.add_request takes one
    def add_request(self, request_id, prompt, params, arrival_time=None, data_parallel_rank=None):
        pass


def test_request_pinning():
    prompt = "Question: x\nAnswer:"
    eng = _Async()
    eng.vllm_config = _config(2)
    assert request_pinning(eng)(prompt) == {"data_parallel_rank": data_parallel_rank(prompt, 2)}
    for engine, config in ((_Async(), _config(1)), (_Sync(), _config(2)),
                           (_Async(), _config(2, backend="external_launcher"))):
        engine.vllm_config = config
        assert request_pinning(engine)(prompt) == {}
    assert request_pinning(object())(prompt) == {}  # a stand-in engine: nothing to pin


# --- the DP replay's routings (python -m evals dp-replay) ---------------------

def _problems(num, n):
    return [(f"p{i}", [1000 + i, 5, 6], [[10 + s, i, 2] for s in range(n)]) for i in range(num)]


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    """dp-replay of 12 problems x 8 paths and 10 x 6 at D = 1, 2, 3, 8 over
    8 rows: {(traces, D): row}."""
    tmp = tmp_path_factory.mktemp("dp")
    traces = [write_traces(tmp / "p12x8.jsonl", _problems(12, 8)), write_traces(tmp / "p10x6.jsonl", _problems(10, 6))]
    ok(run_evals("dp-replay", "--traces", *traces, "--methods", "consensus", "--dp", "1", "2", "3", "8",
                 "--rows", "8", "--option", "cost_model=off", "--no-baseline", "--out", tmp / "dp"))
    return {(r["traces"], r["dp"]): r for r in read_json(tmp / "dp.json")["results"]}


def test_replay_routes_siblings(dp_run):
    problems = _problems(12, 8)
    rr = dp_run[("p12x8", 8)]["round_robin_shares"]
    assert all(n == 1 for share in rr for _, n in share)  # n = D: one sibling each
    pinned = dp_run[("p12x8", 8)]["pinned_shares"]
    seen = collections.Counter(pid for share in pinned for pid, _ in share)
    assert set(seen.values()) == {1} and len(seen) == 12  # each problem on exactly one engine
    assert all(n == 8 for share in pinned for _, n in share)
    for routing in ("round_robin", "pinned"):
        shares = dp_run[("p12x8", 3)][f"{routing}_shares"]
        assert len(shares) == 3 and sum(n for s in shares for _, n in s) == 12 * 8
    # one engine: every problem with all its paths, in order (pinned is the same routing there)
    assert dp_run[("p12x8", 1)]["round_robin_shares"] == [[[pid, len(c)] for pid, _, c in problems]]
    assert dp_run[("p12x8", 1)]["pinned"] == dp_run[("p12x8", 1)]["round_robin"]
    out = run_evals("dp-replay", "--traces", TRACES, "--dp", "2", "--rows", "1")
    assert out.returncode == 2 and "--rows must be >= every --dp" in out.stderr


def test_replay_dp_pinned_equals_separate_engines(dp_run, tmp_path):
    """A pinned engine is exactly one engine replaying its own problems."""
    problems = {pid: (pid, prompt, comps) for pid, prompt, comps in _problems(10, 6)}
    got = dp_run[("p10x6", 2)]
    shares = [write_traces(tmp_path / f"engine{e}.jsonl", [problems[pid] for pid, _ in share])
              for e, share in enumerate(got["pinned_shares"]) if share]
    ok(run_evals("dp-replay", "--traces", *shares, "--methods", "consensus", "--dp", "1", "--rows", "4",
                 "--option", "cost_model=off", "--no-baseline", "--out", tmp_path / "one"))
    alone = read_json(tmp_path / "one.json")["results"]
    assert len(alone) == len(shares) and got["rows_per_engine"] == 4
    tokens = sum(r["round_robin_tokens"] for r in alone)
    steps = sum(r["round_robin_row_steps"] for r in alone)
    assert got["pinned_tokens"] == tokens == recorded_tokens(problems.values())
    assert got["pinned"] == tokens / steps


# --- vLLM's front end honours the rank ---------------------------------------

@pytest.mark.vllm
def test_vllm_reads_the_header():
    """vLLM's OpenAI server takes the rank from this header (read from the
    source: importing the server costs minutes on a small CPU; the slow
    tests/test_parallel.py checks it live)."""
    import importlib.util
    import pathlib
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM (a declared dependency) is not installed"
    root = pathlib.Path(list(spec.submodule_search_locations)[0]) / "entrypoints"
    readers = [f for f in root.rglob("*.py") if "def _get_data_parallel_rank" in f.read_text()]
    assert readers, "vLLM no longer has _get_data_parallel_rank: check how it takes a DP rank"
    assert all(f'headers.get("{DP_RANK_HEADER}")' in f.read_text() for f in readers)


def _stub_lb_client(num_engines):
    """vLLM's DP load balancer without its engines and sockets."""
    from vllm.v1.engine.core_client import DPLBAsyncMPClient
    client = object.__new__(DPLBAsyncMPClient)
    client.core_engines = [i.to_bytes(2, "little") for i in range(num_engines)]
    client.lb_engines = [[0, 0, 0.0] for _ in range(num_engines)]
    client.client_count = 1
    client.eng_start_index = 0
    client.reqs_in_flight = {}
    client.engine_inflight = collections.Counter()
    return client


def _children(request_id, prompt_ids, n, rank):
    """The child requests vLLM's AsyncLLM.add_request sends for an n > 1 request."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.parallel_sampling import ParentRequest
    request = EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                mm_features=None, sampling_params=SamplingParams(n=n),
                                pooling_params=None, arrival_time=0.0, lora_request=None,
                                cache_salt=None, data_parallel_rank=rank,
                                external_req_id=request_id)
    parent = ParentRequest(request)
    children = []
    for idx in range(n):  # as in AsyncLLM.add_request / LLMEngine.add_request
        child_id, child_params = parent.get_child_info(idx)
        child = request if idx == n - 1 else copy(request)
        child.request_id = child_id
        child.sampling_params = child_params
        children.append(child)
    return children


@pytest.mark.vllm
def test_vllm_load_balancer_keeps_pinned_children_together():
    client = _stub_lb_client(2)
    default = collections.Counter()
    for i in range(6):  # no rank: each child routed on its own (a burst: round-robin)
        for child in _children(f"free{i}", [1000 + i, 5, 6, 7], 8, None):
            default[(i, client.get_core_engine_for_request(child))] += 1
    assert all(default[(i, e)] == 4 for i in range(6) for e in client.core_engines)
    for i in range(6):  # with a rank: all children on that engine, whatever the load
        ids = [1000 + i, 5, 6, 7]
        rank = data_parallel_rank(ids, 2)
        engines = {client.get_core_engine_for_request(c) for c in _children(f"pin{i}", ids, 8, rank)}
        assert engines == {client.core_engines[rank]}
