"""consensus_spec: sibling-consensus speculative decoding and voting for vLLM."""

from .config import consensus, speculative_config
from .drafter import ConsensusDrafter, DrafterOptions
from .proposer import ConsensusProposer
from .trie import SuffixTrie

__all__ = [
    "ConsensusDrafter",
    "ConsensusProposer",
    "DrafterOptions",
    "SuffixTrie",
    "consensus",
    "speculative_config",
]
