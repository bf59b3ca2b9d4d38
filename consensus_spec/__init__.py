"""consensus_spec: sibling-consensus speculative decoding and voting for vLLM.

Drafting: ``LLM(model, speculative_config=consensus)``. Voting:
``extract_answer``, ``majority_vote``, ``best_of_n``, ``self_consistency``.
"""

from .answers import answers_equal, extract_answer, normalize_answer
from .config import consensus, speculative_config
from .drafter import ConsensusDrafter, DrafterOptions
from .proposer import ConsensusProposer
from .self_consistency import (
    ProblemResult,
    Sample,
    SelfConsistencyRun,
    SpecDecodeStats,
    self_consistency,
)
from .trie import SuffixTrie
from .voting import AnswerClass, BestOfN, VoteResult, best_of_n, logprob_weights, majority_vote

__all__ = [
    "AnswerClass",
    "BestOfN",
    "ConsensusDrafter",
    "ConsensusProposer",
    "DrafterOptions",
    "ProblemResult",
    "Sample",
    "SelfConsistencyRun",
    "SpecDecodeStats",
    "SuffixTrie",
    "VoteResult",
    "answers_equal",
    "best_of_n",
    "consensus",
    "extract_answer",
    "logprob_weights",
    "majority_vote",
    "normalize_answer",
    "self_consistency",
    "speculative_config",
]
