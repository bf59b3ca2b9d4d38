"""vLLM custom proposer (``method: "custom_class"``): a thin adapter.

vLLM builds it with its ``VllmConfig`` and calls ``propose`` once per step with
the batch's sampled tokens and token buffer. Only ``speculative_config``,
``model_config.max_model_len``, ``additional_config`` and (if present)
``scheduler_config.max_num_seqs`` and ``device_config`` are read, so offline
tools can build it from a light stand-in.

It runs inside someone else's engine, so it never lets an exception out of
``propose``: a failing step is logged, the drafting state is rebuilt, and
that step drafts nothing. After ``max_failures`` failing steps in a row
drafting is switched off for the engine's life. Outputs stay the model's
either way: vLLM verifies every draft.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ..budget import AUTO, DraftBudget, cost_model
from ..drafting.drafter import ConsensusDrafter
from .options import options_from_vllm, parse_options
from .rows import RowTracker

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler and format


class ConsensusProposer:
    options: dict = {}  # set by the classes consensus_spec.vllm.configured makes

    def __init__(self, vllm_config, **options):
        spec = vllm_config.speculative_config
        self.num_speculative_tokens = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        sched = getattr(vllm_config, "scheduler_config", None)
        self._max_num_seqs = int(getattr(sched, "max_num_seqs", 0) or 256)
        merged = {**self.options, **options_from_vllm(vllm_config), **options}
        self.drafter_options, self.proposer_options = parse_options(merged)
        name = self.proposer_options.cost_model
        if name == AUTO:
            device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cuda")
            name = "cpu_embedded" if device == "cpu" else "h200_7b"
        self._cost_model = cost_model(name)
        self.num_drafted = 0   # draft tokens proposed
        self.num_accepted = 0  # of those, accepted by the verifier
        self.num_failures = 0  # steps that raised (and drafted nothing)
        self.num_resets = 0    # times the drafting state was rebuilt after a failure
        self.disabled = False  # switched off after max_failures failing steps in a row
        self._failing = 0      # failing steps in a row
        self._logged: set[str] = set()  # exception types already logged with a traceback
        self._reset()
        self.warmup_s = self._warm_up() if self.proposer_options.warmup else 0.0
        logger.info("consensus_spec proposer: k=%d, cost model %s, %s (warm-up %.2f s)",
                    self.num_speculative_tokens, name, self.drafter_options, self.warmup_s)

    def _reset(self) -> None:
        """Fresh drafting state (trie forest, row tracking, calibration)."""
        self.drafter = ConsensusDrafter(self.drafter_options)
        self.budget = DraftBudget(self._cost_model) if self._cost_model is not None else None
        self.rows = RowTracker(self.drafter.add_path, self.drafter.release,
                               max_parked=64 + 4 * self._max_num_seqs)
        self._sent = None  # (rows, paths, estimates, lengths) of the drafts last sent

    def _warm_up(self) -> float:
        """Run every compiled kernel once on a made-up batch (vLLM's dtypes),
        so the first request pays no compilation; then start afresh."""
        t0 = time.perf_counter()
        tokens = np.zeros((2, 64), np.int32)
        lengths = np.array([8, 8], np.int32)
        tokens[:, :8] = np.arange(8)
        try:
            for step in range(3):
                sampled = [[20 + step], [20 + step]]
                tokens[:, lengths[0]] = 20 + step
                lengths += 1
                self._propose(sampled, lengths, tokens)
        except Exception:  # noqa: BLE001 - the first real step will tell
            logger.warning("consensus_spec: warm-up failed; kernels compile on first use",
                           exc_info=True)
        self._reset()
        return time.perf_counter() - t0

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        """One draft list per row (possibly empty). Never raises."""
        if not self.disabled:
            try:
                drafts = self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
                self._failing = 0
                return drafts
            except Exception as error:  # noqa: BLE001 - never take the engine down
                self._contain(error)
        try:
            return [[] for _ in range(len(sampled_token_ids))]
        except Exception:  # noqa: BLE001 - not even a length: vLLM is broken already
            return []

    def _contain(self, error: Exception) -> None:
        self.num_failures += 1
        self._failing += 1
        kind = type(error).__name__
        first = kind not in self._logged
        self._logged.add(kind)
        logger.warning("consensus_spec: drafting step failed (%s: %s); no drafts this step, "
                       "drafting state reset (failure %d, %d in a row)", kind, error,
                       self.num_failures, self._failing, exc_info=first)
        if self._failing >= self.proposer_options.max_failures:
            self.disabled = True
            logger.error("consensus_spec: %d drafting steps failed in a row; drafting is off "
                         "for this engine's life (outputs are unaffected)", self._failing)
            return
        try:
            self._reset()
            self.num_resets += 1
        except Exception:  # noqa: BLE001 - cannot even rebuild: stop drafting
            self.disabled = True
            logger.error("consensus_spec: drafting state could not be rebuilt; drafting is off",
                         exc_info=True)

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> list[list[int]]:
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

    def counters(self) -> dict:
        """The proposer's counters (cumulative over the engine's life)."""
        rows = self.rows
        return {
            "num_drafted": self.num_drafted, "num_accepted": self.num_accepted,
            "num_failures": self.num_failures, "num_resets": self.num_resets,
            "disabled": self.disabled, "paths_started": rows.paths_started,
            "paths_resumed": rows.paths_resumed, "paths_moved": rows.paths_moved,
            "tokens_missed": rows.tokens_missed, "num_groups": self.drafter.num_groups,
            "trie_nodes": self.drafter.num_nodes(),
        }

    def load_model(self, *args, **kwargs) -> None:
        pass  # model-free
