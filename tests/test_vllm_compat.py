import sys

import pytest

torch = pytest.importorskip("torch")

from consensus_spec.vllm_compat import expand_batch_to_tokens  # noqa: E402


def test_expand_spreads_per_request_values_over_draft_positions():
    temps = torch.tensor([0.8, 0.0, 0.5])
    cu = torch.tensor([2, 3, 6], dtype=torch.int32)  # 2, 1 and 3 draft tokens
    got = expand_batch_to_tokens(temps, cu, 6, replace_from=0.0, replace_to=1)
    assert torch.equal(got, torch.tensor([0.8, 0.8, 1.0, 0.5, 0.5, 0.5]))
    top_k = torch.tensor([5, 1], dtype=torch.int32)
    assert expand_batch_to_tokens(top_k, torch.tensor([1, 3]), 3).tolist() == [5, 1, 1]


def test_plugin_leaves_vllm_with_a_working_expand():
    pytest.importorskip("vllm")
    from vllm.plugins import load_general_plugins
    from vllm.v1.sample import rejection_sampler

    load_general_plugins()  # runs consensus_spec.vllm_compat.register via its entry point
    got = rejection_sampler.expand_batch_to_tokens(
        torch.tensor([0.75, 0.25]), torch.tensor([2, 3], dtype=torch.int32), 3,
        replace_from=0, replace_to=1)
    assert torch.equal(got, torch.tensor([0.75, 0.75, 0.25]))


def test_kernel_scan_survives_numba_being_loaded():
    pytest.importorskip("vllm")
    pytest.importorskip("numba")
    import llvmlite.binding  # noqa: F401 - the module vLLM's scan trips over
    from vllm.plugins import load_general_plugins
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    if not current_platform.is_cpu():
        pytest.skip("the scan fix is installed on CPU builds only")
    load_general_plugins()
    dispatcher._rebind_kernels([])  # raised AttributeError before the fix
    assert "llvmlite.binding.ffi" in sys.modules  # hidden only during the scan
