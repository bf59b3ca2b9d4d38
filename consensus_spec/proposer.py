"""vLLM custom proposer (``method: "custom_class"``): a thin adapter.

vLLM builds it with its ``VllmConfig`` and calls ``propose`` once per step with
the batch's sampled tokens and token buffer. Only ``speculative_config`` and
``model_config.max_model_len`` (and ``scheduler_config.max_num_seqs`` if
present) are read, so offline tools can build it from a light stand-in.
"""

from __future__ import annotations

from .drafter import ConsensusDrafter, DrafterOptions
from .rows import RowTracker


class ConsensusProposer:
    options: dict = {}  # drafter options; subclasses made by consensus_spec.configured set them

    def __init__(self, vllm_config, **options):
        spec = vllm_config.speculative_config
        self.num_speculative_tokens = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        sched = getattr(vllm_config, "scheduler_config", None)
        max_num_seqs = int(getattr(sched, "max_num_seqs", 0) or 256)
        self.drafter = ConsensusDrafter(DrafterOptions.from_dict({**self.options, **options}))
        self.rows = RowTracker(self.drafter.add_path, max_parked=64 + 4 * max_num_seqs)
        self.num_drafted = 0   # draft tokens proposed
        self.num_accepted = 0  # of those, accepted by the verifier
        self._drafted_last: dict[int, int] = {}

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        rows = self.rows.update(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        drafted_last, self._drafted_last = self._drafted_last, {}
        # Record every row's new tokens before drafting any, so each path
        # drafts from its siblings' tokens of this very step.
        for i, entry in enumerate(rows):
            if entry is not None:
                path, new, contiguous = entry
                if contiguous and i in drafted_last:
                    self.num_accepted += min(len(sampled_token_ids[i]) - 1, drafted_last[i])
                self.drafter.extend(path, new)
        drafts: list[list[int]] = []
        for i, entry in enumerate(rows):
            budget = 0 if entry is None else min(
                self.num_speculative_tokens, self.max_model_len - int(num_tokens_no_spec[i]) - 1)
            draft = self.drafter.draft(entry[0], budget) if budget > 0 else []
            if draft:
                self.num_drafted += len(draft)
                self._drafted_last[i] = len(draft)
            drafts.append(draft)
        return drafts

    def load_model(self, *args, **kwargs) -> None:
        pass  # model-free
