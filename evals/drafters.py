"""The drafters a replay compares, each built the way vLLM builds it and
called through the same arguments vLLM's model runner passes it."""

from __future__ import annotations

from types import SimpleNamespace

METHODS = ("none", "ngram", "suffix", "consensus")


def stand_in_config(k: int, max_model_len: int, max_num_seqs: int, **spec) -> SimpleNamespace:
    """The parts of ``VllmConfig`` the model-free proposers read, with vLLM's defaults."""
    spec_defaults = dict(
        num_speculative_tokens=k,
        prompt_lookup_min=5, prompt_lookup_max=5,  # vLLM's ngram defaults
        suffix_decoding_max_tree_depth=24,
        suffix_decoding_max_cached_requests=10000,
        suffix_decoding_max_spec_factor=1.0,
        suffix_decoding_min_token_prob=0.1,
    )
    spec_defaults.update(spec)
    return SimpleNamespace(
        speculative_config=SimpleNamespace(**spec_defaults),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


def make_drafter(method: str, k: int, max_model_len: int, max_num_seqs: int,
                 consensus_options: dict | None = None):
    """A callable ``(sampled_token_ids, batch) -> drafts`` for ``method``."""
    cfg = stand_in_config(k, max_model_len, max_num_seqs)
    if method == "none":
        return lambda sampled, batch: [[] for _ in sampled]
    if method == "ngram":
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer
        p = NgramProposer(cfg)
        return lambda sampled, batch: p.propose(
            k, sampled, batch.num_tokens_no_spec, batch.token_ids_cpu)
    if method == "suffix":
        from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
        p = SuffixDecodingProposer(cfg)
        return lambda sampled, batch: p.propose(k, batch, sampled)
    if method == "consensus":
        from consensus_spec import ConsensusProposer
        p = ConsensusProposer(cfg, **(consensus_options or {}))
        return lambda sampled, batch: p.propose(
            sampled, batch.num_tokens_no_spec, batch.token_ids_cpu)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
