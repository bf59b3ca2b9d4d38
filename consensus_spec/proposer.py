"""vLLM custom proposer (``method: "custom_class"``): a thin adapter.

vLLM builds it with its ``VllmConfig`` and calls ``propose`` once per step with
the batch's sampled tokens and token buffer. Only ``speculative_config`` and
``model_config.max_model_len`` (and ``scheduler_config.max_num_seqs`` if
present) are read, so offline tools can build it from a light stand-in.
"""

from __future__ import annotations

import numpy as np

from .budget import AcceptanceCalibrator, choose_lengths, cost_model
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
        self.cost = cost_model(self.drafter.options.cost_model)
        self.rows = RowTracker(self.drafter.add_path, max_parked=64 + 4 * max_num_seqs)
        self.num_drafted = 0   # draft tokens proposed
        self.num_accepted = 0  # of those, accepted by the verifier
        self.calibrator = AcceptanceCalibrator()
        self._sent = None  # (rows, paths, estimates, lengths) of the drafts last sent

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        rows = self.rows.update(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        live = [i for i, entry in enumerate(rows) if entry is not None]
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        if not live:
            self._sent = None
            return drafts
        self._observe(rows, sampled_token_ids)
        paths = [rows[i][0] for i in live]
        # every row's new tokens go in before any row drafts, so each path
        # drafts from its siblings' tokens of this very step
        self.drafter.extend(paths, [rows[i][1] for i in live])
        idx = np.asarray(live)
        room = np.clip(self.max_model_len - 1 - np.asarray(num_tokens_no_spec)[idx],
                       0, self.num_speculative_tokens)
        tokens, probs, lengths = self.drafter.draft(paths, room)
        if self.cost is not None and tokens.size:
            lengths = choose_lengths(self.calibrator(probs), lengths, len(sampled_token_ids), self.cost)
        for j, n in enumerate(lengths):
            if n:
                drafts[live[j]] = tokens[j, :n].tolist()
        self.num_drafted += int(np.sum(lengths))
        self._sent = (idx, paths, probs, np.asarray(lengths))
        return drafts

    def _observe(self, rows, sampled_token_ids) -> None:
        """Count what the verifier kept of last step's drafts; calibrate on it."""
        if self._sent is None:
            return
        idx, paths, probs, sent = self._sent
        accepted = np.zeros(len(idx), np.int64)
        for j, i in enumerate(idx):
            # only rows that still hold the same path, with no missed step
            if sent[j] and i < len(rows) and rows[i] is not None and rows[i][2] and rows[i][0] is paths[j]:
                accepted[j] = min(len(sampled_token_ids[i]) - 1, sent[j])
            else:
                sent[j] = 0
        self.num_accepted += int(accepted.sum())
        self.calibrator.observe(probs, sent, accepted)

    def load_model(self, *args, **kwargs) -> None:
        pass  # model-free
