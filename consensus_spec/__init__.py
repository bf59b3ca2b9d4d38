"""consensus_spec: sibling-consensus speculative decoding and self-consistency for vLLM.

Two products share this package:

- drafting for vLLM: ``LLM(model, **engine_args())`` or
  ``speculative_config=consensus`` (``vllm/`` adapter over ``drafting/`` and ``budget/``);
- voting and sampling: ``extract_answer``, ``majority_vote``, ``best_of_n``,
  ``should_stop``, ``self_consistency`` (``voting/``, ``sampling/``).

Importing it is light: numba loads when the first drafter is built, vLLM and
math-verify when first used.
"""

from .drafting.drafter import ConsensusDrafter, DrafterOptions
from .sampling.results import ProblemResult, Sample, SelfConsistencyRun, SpecDecodeStats
from .sampling.routing import data_parallel_rank, rank_headers, shard
from .sampling.self_consistency import Voting, self_consistency
from .sampling.answer_prior import AnswerPrior
from .sampling.stopping import StopRule, should_stop
from .sampling.waves import Schedule
from .vllm.options import ProposerOptions, consensus, engine_args
from .vllm.proposer import ConsensusProposer
from .voting.answers import answers_equal, extract_answer, normalize_answer
from .voting.vote import (AnswerClass, BestOfN, VoteResult, best_of_n, logprob_weights,
                          majority_vote)

__all__ = [
    "AnswerClass", "AnswerPrior", "BestOfN", "ConsensusDrafter", "ConsensusProposer", "DrafterOptions",
    "ProblemResult", "ProposerOptions", "Sample", "Schedule", "SelfConsistencyRun",
    "SpecDecodeStats", "StopRule", "VoteResult", "Voting", "answers_equal", "best_of_n", "consensus",
    "data_parallel_rank", "engine_args", "extract_answer", "logprob_weights", "majority_vote",
    "normalize_answer", "rank_headers", "self_consistency", "shard", "should_stop",
]


def __getattr__(name: str):
    if name == "speculative_config":  # 0.1's class-name option channel
        from .vllm.configured import REMOVED
        raise AttributeError(f"consensus_spec.speculative_config was removed: {REMOVED}")
    raise AttributeError(f"module 'consensus_spec' has no attribute {name!r}")
