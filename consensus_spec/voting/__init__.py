"""Voting: answer extraction, equivalence (math-verify, under timeouts),
majority and weighted votes, Best-of-N. Knows nothing of drafting or vLLM."""

from .answers import answers_equal, extract_answer, normalize_answer
from .vote import (AnswerClass, BestOfN, VoteResult, best_of_n, cluster_answers,
                   logprob_weights, majority_vote)

__all__ = ["AnswerClass", "BestOfN", "VoteResult", "answers_equal", "best_of_n", "cluster_answers",
           "extract_answer", "logprob_weights", "majority_vote", "normalize_answer"]
