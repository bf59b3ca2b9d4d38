"""vLLM custom proposer (``method: "custom_class"``): a thin adapter.

vLLM builds it with its ``VllmConfig`` and calls ``propose`` once per step with
the batch's sampled tokens and token buffer. Only ``speculative_config`` and
``model_config.max_model_len`` (and ``scheduler_config.max_num_seqs`` if
present) are read, so offline tools can build it from a light stand-in.
"""

from __future__ import annotations

import numpy as np

from .budget import AUTO, DraftBudget, cost_model
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
        name = self.drafter.options.cost_model
        if name == AUTO:
            device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cuda")
            name = "cpu_embedded" if device == "cpu" else "h200_7b"
        model = cost_model(name)
        self.budget = DraftBudget(model) if model is not None else None
        self.rows = RowTracker(self.drafter.add_path, self.drafter.release,
                               max_parked=64 + 4 * max_num_seqs)
        self.num_drafted = 0   # draft tokens proposed
        self.num_accepted = 0  # of those, accepted by the verifier
        self._sent = None  # (rows, paths, estimates, lengths) of the drafts last sent

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        num_rows = len(sampled_token_ids)
        step = self.rows.update(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        if not len(step.rows):
            self._sent = None
            return drafts
        self._observe()
        room = np.minimum(self.max_model_len - 1 - step.ends, self.num_speculative_tokens)  # < 0: none
        floor = self.budget.floor(num_rows) if self.budget is not None else None
        # every row's new tokens go in before any row drafts, so each path
        # drafts from its siblings' tokens of this very step
        tokens, probs, lengths = self.drafter.extend_and_draft(
            step.paths, token_ids_cpu, step.rows, step.begins, step.ends, room, floor)
        if self.budget is not None:
            lengths = self.budget(probs, lengths, num_rows)
        for i, draft, n in zip(step.rows.tolist(), tokens.tolist(), lengths.tolist()):
            if n:
                drafts[i] = draft[:n]
        self.num_drafted += int(lengths.sum())
        self._sent = (step.rows, step.paths, probs, np.asarray(lengths, np.int64))
        return drafts

    def _observe(self) -> None:
        """Count what the verifier kept of last step's drafts; calibrate on it."""
        if self._sent is None:
            return
        rows, paths, probs, sent = self._sent
        accepted = self.rows.accepted(rows, paths, sent)  # zeroes sent where not judged
        self.num_accepted += int(accepted.sum())
        if self.budget is not None:
            self.budget.observe(probs, sent, accepted)

    def load_model(self, *args, **kwargs) -> None:
        pass  # model-free
