"""Drafting: the probabilistic token-trie forest and the sibling-consensus
drafter. Knows nothing of vLLM or of the draft budget."""

from .drafter import ConsensusDrafter, DrafterOptions
from .forest import SuffixForest

__all__ = ["ConsensusDrafter", "DrafterOptions", "SuffixForest"]
