"""The device route's vLLM speculator (``consensus_spec/vllm/device_speculator.py``)
on CPU tensors with vLLM's own ``RequestState`` and ``InputBatch``: drafts
equal the replay's emulation token for token, a lag never lets a token be
drafted before it is visible, the table's shared part stays under its cap,
a dummy run does nothing, departed requests release their state, failures
stay inside, and the ngram slot is taken only after the probes pass."""

import json
import logging
import os

import pytest
import torch

from tests.evals_cli import FIXTURES, STEP_COSTS, char_tokenizer, ok, read_json, run_evals
from tests.v2_runner import Runner, config

EMBEDDED = os.path.join(FIXTURES, "embedded_n8.jsonl")


def replay(tmp, name, rows, k, *extra):
    ok(run_evals("replay", "--traces", EMBEDDED, "--tokenizer", char_tokenizer(tmp / "tok.json"),
                 "--methods", "device-lag1", "device-emul-lag1", "device-lag2", "device-emul-lag2",
                 "--batches", *rows, "--k", k, "--sweep-k", "0", "--schedules", "fixed",
                 "--repeats", "1", "--costs", STEP_COSTS, "--host-time", "none", *extra,
                 "--out", tmp / name))
    return read_json(tmp / f"{name}.json")["results"]


def by(results, method, batch):
    return next(r for r in results if r["method"] == method and r["batch"] == batch)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    return replay(tmp_path_factory.mktemp("dev"), "eq", (5, 16), 4)


@pytest.mark.parametrize("lag", [1, 2])
@pytest.mark.parametrize("rows", [5, 16])
def test_drafts_equal_the_emulation_token_for_token(replayed, lag, rows):
    mine, emulated = by(replayed, f"device-lag{lag}", rows), by(replayed, f"device-emul-lag{lag}", rows)
    assert mine["drafter_calls"] > 20 and mine["drafted"] > 0
    assert mine["drafts_sha1"] == emulated["drafts_sha1"]  # every call's drafts, in order
    assert (mine["tau"], mine["drafted"], mine["accepted"]) == \
        (emulated["tau"], emulated["drafted"], emulated["accepted"])
    assert mine["hit_rate"] == pytest.approx(emulated["hit_rate"])
    assert mine["drafted"] == 4 * mine["row_steps"]  # exactly K per row


def test_the_shared_table_stays_under_its_cap(tmp_path):
    cap = 10_000
    results = replay(tmp_path, "cap", (16,), 4, "--option", f"cross_entries={cap}")
    mine, emulated = by(results, "device-lag1", 16), by(results, "device-emul-lag1", 16)
    assert mine["cross_restarts"] >= 1  # the cap was reached (and the cross trie restarted)
    assert 0 < mine["table_cross_entries_max"] <= cap
    assert mine["drafts_sha1"] == emulated["drafts_sha1"]


def test_a_lag_never_drafts_a_token_before_it_is_visible():
    prompt = [1, 2, 3, 4]
    for lag in (1, 2):
        run = Runner(k=2, max_rows=4, lag=lag)
        run.add("a", prompt)
        run.add("b", prompt)
        seen = []
        # call 1: a writes 5, 77 (77 after 5 exists nowhere else); b writes 9
        seen.append(run.step({"a": [5, 77], "b": [9]})["b"])
        for _ in range(4):  # b keeps writing 5: its context ends with 5 at every call
            seen.append(run.step({"a": [6], "b": [5]})["b"])
        first = next(i for i, d in enumerate(seen) if d[0] == 77)
        assert first == lag, (lag, seen)  # visible from call 1 + lag, never before


def test_a_dummy_run_does_nothing():
    run = Runner(k=3, max_rows=4)
    run.add("a", [1, 2, 3])
    before = run.speculator.drafts.clone()
    out = run.step({"a": [4]}, dummy_run=True)
    assert out == {"a": before[0, :3].tolist()}
    spec = run.speculator
    assert spec.route.paths == {} and spec.route.tries.calls == 0 and spec.route.table.size == 0
    assert torch.equal(spec.drafts, before)
    assert run.step({"a": [4]})["a"] == [4, 4, 4]  # a real step then runs (a miss: fill tokens)


def test_requests_that_come_and_go_release_their_state():
    run = Runner(k=2, max_rows=8, lag=2)
    spec = run.speculator
    for wave in range(12):
        ids = [f"w{wave}-{i}" for i in range(6)]
        for r in ids:
            run.add(r, [100 + wave % 3, 7, 8])
        for t in range(3):
            run.step({r: [10 + t, 11] for r in ids})
        for r in ids:
            run.remove(r)
    for _ in range(3):  # the lag's worth of calls with no rows
        run.step({})
    d = spec.route.tries.drafter
    assert spec.route.paths == {} and d.num_paths == 0 and d.num_live_groups == 0
    assert d.path_slots <= 64  # ids were reused: never more than the live ones
    assert spec._prompts == {} and not spec.route.tries.pending and not spec.route.tries.releases


def test_a_failing_step_drafts_fill_tokens_and_never_raises(caplog):
    run = Runner(k=3, max_rows=4, max_failures=2)
    run.add("a", [1, 2, 3])
    spec = run.speculator

    def broken(*args, **kwargs):
        raise RuntimeError("boom")
    with caplog.at_level(logging.WARNING):
        spec.route.step = broken
        assert run.step({"a": [4]})["a"] == [4, 4, 4]
        assert spec.num_failures == 1 and not spec.disabled  # state rebuilt: a fresh route
        spec.route.step = broken
        assert run.step({"a": [5]})["a"] == [5, 5, 5]
    assert spec.disabled and "step failed" in caplog.text
    assert run.step({"a": [6]})["a"] == [6, 6, 6]  # off: fill tokens only


def test_the_slot_is_taken_only_after_the_probes_pass(monkeypatch, caplog):
    from vllm.v1.worker.gpu.spec_decode.ngram import speculator as slot

    from consensus_spec.vllm import device_speculator as dr

    original = slot.NgramGPUSpeculator
    monkeypatch.setattr(dr, "_installed", [])
    assert all(holds for _, holds in dr.probes()), dr.probes()  # this vLLM (0.32) passes
    monkeypatch.setattr(dr, "probes", lambda: [("a fact", True), ("another fact", False)])
    with caplog.at_level(logging.WARNING):
        assert dr.install() is False
    assert slot.NgramGPUSpeculator is original and caplog.text.count("not installed") == 1
    monkeypatch.undo()
    monkeypatch.setattr(dr, "_installed", [])
    try:
        assert dr.register() is False  # not a CUDA platform: untouched
        assert slot.NgramGPUSpeculator is original
        assert dr.install() is True
        factory = slot.NgramGPUSpeculator
        assert factory is not original
        states = Runner(k=2, max_rows=2).states  # a speculator for route=device ...
        built = factory(config(2, 2, 256), torch.device("cpu"), states)
        assert type(built).__name__ == "ConsensusDeviceSpeculator"
        plain = config(2, 2, 256)
        plain.additional_config = {}
        with pytest.raises(RuntimeError, match="Triton"):  # ... vLLM's own class otherwise
            factory(plain, torch.device("cpu"), states)
    finally:
        slot.NgramGPUSpeculator = original


def test_gpu_check_runs_at_toy_sizes(tmp_path):
    ok(run_evals("gpu-check", "--toy", "--device", "cpu", "--out", tmp_path))
    records = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    checks = {r["check"] for r in records}
    assert {"meta", "gather", "overlap", "lag", "step_costs"} <= checks
    assert all(r["eager_ms_median"] > 0 for r in records if r["check"] == "gather")
    assert any(r["check"] == "lag" and r["copies_seen"] > 0 for r in records)
