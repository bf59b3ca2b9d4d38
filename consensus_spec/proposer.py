"""vLLM custom proposer (``method: "custom_class"``): a thin adapter.

vLLM builds it with its ``VllmConfig`` and calls ``propose`` once per step with
the batch's sampled tokens and token buffer. Only ``speculative_config`` and
``model_config.max_model_len`` (and ``scheduler_config.max_num_seqs`` if
present) are read, so offline tools can build it from a light stand-in.
"""

from __future__ import annotations

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
        self._sent: dict[int, list[float]] = {}  # row -> estimates of the draft it was sent

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        rows = self.rows.update(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        sent, self._sent = self._sent, {}
        seen_probs, seen_accepted = [], []
        # Record every row's new tokens before drafting any, so each path
        # drafts from its siblings' tokens of this very step.
        for i, entry in enumerate(rows):
            if entry is not None:
                path, new, contiguous = entry
                if contiguous and i in sent:
                    accepted = min(len(sampled_token_ids[i]) - 1, len(sent[i]))
                    self.num_accepted += accepted
                    seen_probs.append(sent[i])
                    seen_accepted.append(accepted)
                self.drafter.extend(path, new)
        self.calibrator.observe(seen_probs, seen_accepted)
        drafts: list[list[int]] = []
        probs: list[list[float]] = []
        for i, entry in enumerate(rows):
            room = 0 if entry is None else min(
                self.num_speculative_tokens, self.max_model_len - int(num_tokens_no_spec[i]) - 1)
            draft, p = self.drafter.draft(entry[0], room) if room > 0 else ([], [])
            drafts.append(draft)
            probs.append(p)
        if self.cost is not None:
            lengths = choose_lengths([self.calibrator(p) for p in probs],
                                     len(sampled_token_ids), self.cost)
            drafts = [d[:n] for d, n in zip(drafts, lengths)]
        for i, draft in enumerate(drafts):
            if draft:
                self.num_drafted += len(draft)
                self._sent[i] = probs[i][:len(draft)]  # raw estimates, for calibration
        return drafts

    def load_model(self, *args, **kwargs) -> None:
        pass  # model-free
