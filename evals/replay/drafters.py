"""The drafters a replay compares, each built the way vLLM builds it and
called through the same arguments vLLM's model runner passes it.

Methods:

- ``none``: no drafting.
- ``ngram``, ``suffix``: vLLM's proposers. With a ``schedule`` (vLLM's
  ``num_speculative_tokens_per_batch_size``: ``[(first_B, last_B, k), ...]``)
  each step's k is vLLM's own lookup (``build_dynamic_sd_schedule_lookup``)
  at the step's batch size, the number of scheduled requests, as vLLM's
  scheduler and model runner pass it to ``propose``; k = 0 drafts nothing,
  but the proposer is still called (suffix keeps its cache current).
  vLLM 0.32's ``SuffixDecodingProposer.propose`` asserts that the scheduled k
  equals ``num_speculative_tokens``, so a suffix schedule that ever asks for
  less fails there as shipped; the replay relaxes that assertion (the
  proposer drafts at most the scheduled k).
- ``suffix-budget``: suffix under this project's budget (:class:`BudgetedSuffix`).
- ``consensus``: this project's proposer (``custom_class``); vLLM 0.32 passes
  custom proposers no scheduled k, so no schedule applies.
- ``consensus-nobudget``: the same with ``cost_model=off`` (the drafter alone).
- ``consensus-truth``: the same with its budget told the true step costs
  (the ``--costs`` table the replay projects on, as its ``cost_model``)
  and nothing learned: what learning is measured against.
- ``device-lag0|1|2``: the device route's vLLM speculator itself, consensus
  tries fed sibling tokens 0, 1 or 2 steps late; ``device-emul-lag0|1|2``: the
  emulation the route was decided on, whose drafts must equal the
  speculator's token for token (``drafts_sha1``); both in
  :mod:`evals.replay.device_drafters`.  Model Runner V2 passes its
  speculators the scheduled k, so a schedule applies.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

EMULATED_METHODS = ("device-emul-lag0", "device-emul-lag1", "device-emul-lag2")
DEVICE_METHODS = ("device-lag0", "device-lag1", "device-lag2") + EMULATED_METHODS  # not run by default
METHODS = ("none", "ngram", "suffix", "suffix-budget", "consensus-nobudget", "consensus",
           "consensus-truth") + DEVICE_METHODS
BASELINES = ("ngram", "suffix", "suffix-budget")  # what consensus is compared against
SCHEDULABLE = ("ngram", "suffix") + DEVICE_METHODS  # vLLM passes these the scheduled k
SUFFIX_DEFAULTS = dict(suffix_decoding_max_tree_depth=24, suffix_decoding_max_cached_requests=10000,
                       suffix_decoding_max_spec_factor=1.0, suffix_decoding_min_token_prob=0.1)


def stand_in_config(k: int, max_model_len: int, max_num_seqs: int, **spec) -> SimpleNamespace:
    """The parts of ``VllmConfig`` the model-free proposers read, with vLLM's
    defaults (ngram's lookup 5..5, suffix's ``SUFFIX_DEFAULTS``) under ``spec``."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(**{"num_speculative_tokens": k, "prompt_lookup_min": 5,
                                              "prompt_lookup_max": 5, **SUFFIX_DEFAULTS, **spec}),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


MACHINE = "replay"  # the device name a replay's step-cost memory is kept under


def name_machine(cfg, model: str) -> None:
    """Give a stand-in config what the proposer's step-cost memory keys on."""
    cfg.model_config.model = model
    cfg.model_config.dtype = MACHINE
    cfg.parallel_config.data_parallel_size = 1
    cfg.device_config = SimpleNamespace(device_type="cuda", device_name=MACHINE)


def schedule_lookup(schedule, max_num_seqs: int, k: int) -> list[int]:
    """vLLM's dense batch size -> k table for a ``num_speculative_tokens_per_batch_size``
    schedule (vLLM's own function: k capped at ``num_speculative_tokens``, gaps
    and the tail carried forward). Index 0 is unused."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    return build_dynamic_sd_schedule_lookup([list(e) for e in schedule], max_num_seqs, k)


def _scheduled_k(k: int, max_num_seqs: int, schedule):
    """``rows -> k`` for a step with ``rows`` scheduled requests."""
    if schedule is None:
        return lambda rows: k
    table = schedule_lookup(schedule, max_num_seqs, k)
    return lambda rows: table[min(max(rows, 1), len(table) - 1)]


class BudgetedSuffix:
    """vLLM's ``SuffixDecodingProposer`` at full k, its drafts cut by
    consensus_spec's batch-aware budget (``DraftBudget``) on arctic
    inference's per-token probability estimates, calibrated online as
    consensus does.

    Each step: the verifier's verdict on last step's drafts is read off the
    sampled tokens (a row that was sent n drafts and now shows m sampled
    tokens had min(m - 1, n) accepted), calibrating the budget; the budget's
    floor becomes suffix's ``min_token_prob`` when higher (the tree walk stops
    where no token could pay, as consensus's drafter does); vLLM's propose
    runs unchanged at full k; the budget then keeps the draft prefixes that
    maximise expected tokens per unit of step time.
    """

    def __init__(self, cfg, k: int, cost_model_name: str = "h200_7b"):
        from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

        from consensus_spec.budget import DraftBudget, cost_model

        self.proposer = SuffixDecodingProposer(cfg)
        self.k = k
        self.budget = DraftBudget(cost_model(cost_model_name))
        self.base_min_prob = float(self.proposer.min_token_prob)
        self.num_drafted = 0
        self.num_accepted = 0
        self._probs: dict = {}   # req_id -> probability estimates of this step's draft
        self._sent: dict = {}    # req_id -> (estimates, tokens sent) of the last step
        cache = self.proposer.suffix_cache
        speculate = cache.speculate

        def recording(req_id, *args, **kwargs):
            draft = speculate(req_id, *args, **kwargs)
            self._probs[req_id] = draft.probs
            return draft

        cache.speculate = recording  # instance attribute: vLLM's propose calls it per row

    def __call__(self, sampled, batch) -> list[list[int]]:
        rows = len(sampled)
        req_ids = batch.req_ids[:rows]
        self._observe(sampled, req_ids)
        self.proposer.min_token_prob = max(self.base_min_prob, self.budget.floor(rows))
        self._probs.clear()
        drafts = self.proposer.propose(self.k, batch, sampled)
        probs = np.zeros((rows, self.k))
        lengths = np.zeros(rows, np.int64)
        for i, draft in enumerate(drafts):
            if draft:
                n = min(len(draft), self.k)
                probs[i, :n] = self._probs[req_ids[i]][:n]
                lengths[i] = n
        keep = self.budget(probs, lengths, rows).tolist()
        self._sent = {req_ids[i]: (probs[i], n) for i, n in enumerate(keep) if n}
        self.num_drafted += int(sum(keep))
        return [list(d[:n]) for d, n in zip(drafts, keep)]

    def budget_stats(self) -> dict:
        """What the budget sent and learned: draft tokens sent, accepted ones
        among those judged, and the calibrator's (decaying) trial count
        against its prior's."""
        cal = self.budget.calibrator
        return {"on": True, "drafted": self.num_drafted, "accepted_judged": self.num_accepted,
                "calibration_trials": float(cal.counts()[1].sum()), "calibration_prior_trials": cal.prior * cal.bins}

    def _observe(self, sampled, req_ids) -> None:
        judged = [(i, self._sent[r]) for i, r in enumerate(req_ids) if r in self._sent]
        self._sent = {}
        if not judged:
            return
        probs = np.stack([p for _, (p, _) in judged])
        sent = np.array([n for _, (_, n) in judged], np.int64)
        accepted = np.array([min(max(len(sampled[i]) - 1, 0), n) for i, (_, n) in judged], np.int64)
        self.num_accepted += int(accepted.sum())
        self.budget.observe(probs, sent, accepted)


class ProposerDrafter:
    """The consensus proposer called as vLLM's runner calls it."""

    def __init__(self, proposer):
        self.proposer = proposer

    def budget_stats(self) -> dict:
        return {"on": self.proposer.budget is not None}

    def __call__(self, sampled, batch):
        return self.proposer.propose(sampled, batch.num_tokens_no_spec, batch.token_ids_cpu)


def make_drafter(method: str, k: int, max_model_len: int, max_num_seqs: int,
                 consensus_options: dict | None = None, schedule=None,
                 suffix_options: dict | None = None, clock=None, model: str | None = None,
                 package=None):
    """A callable ``(sampled_token_ids, batch) -> drafts`` for ``method``.

    ``schedule``: vLLM's ``num_speculative_tokens_per_batch_size`` for ngram
    and suffix. ``suffix_options``: ``suffix_decoding_*`` settings for suffix
    (and suffix-budget). ``clock``: the time consensus's proposer reads to
    learn step costs (a :class:`evals.replay.engine.VirtualClock`); without one a
    replay has no step times, so its budget keeps the fixed cost model.
    ``model``: the machine's name where consensus remembers its step costs
    (:class:`evals.replay.projection.StartupCosts`). ``package``: the
    ``consensus_spec`` module whose proposer consensus runs (another
    commit's: :mod:`evals.measure.previous`).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    if schedule is not None and method not in SCHEDULABLE:
        raise ValueError(f"vLLM applies num_speculative_tokens_per_batch_size to {SCHEDULABLE} "
                         f"only, not to {method!r}")
    cfg = stand_in_config(k, max_model_len, max_num_seqs, **(suffix_options or {}))
    if model is not None:
        name_machine(cfg, model)
    k_at = _scheduled_k(k, max_num_seqs, schedule)
    if method == "none":
        return lambda sampled, batch: [[] for _ in sampled]
    if method == "ngram":
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer
        p = NgramProposer(cfg)
        return lambda sampled, batch: p.propose(
            k_at(len(sampled)), sampled, batch.num_tokens_no_spec, batch.token_ids_cpu)
    if method == "suffix":
        from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
        p = SuffixDecodingProposer(cfg)

        def suffix(sampled, batch):
            k_step = k_at(len(sampled))
            p.num_speculative_tokens = k_step  # relaxes vLLM's assertion (see module doc)
            return p.propose(k_step, batch, sampled)
        return suffix
    if method == "suffix-budget":
        return BudgetedSuffix(cfg, k)
    if method in EMULATED_METHODS:
        from consensus_spec.device_route.options import drafter_options
        from consensus_spec.vllm.options import split_options

        from .device_drafters import DeviceRouteDrafter
        lag = int(method.removeprefix("device-emul-lag"))
        options, _, route = split_options({**(consensus_options or {}), "lag": lag})
        # the options the speculator runs with (its cross-group cap), so drafts can match
        options = drafter_options(options, route, max_num_seqs, k + 1)
        return DeviceRouteDrafter(lag, k_at, options)
    if method in DEVICE_METHODS:
        from .device_drafters import SpeculatorDrafter
        return SpeculatorDrafter(int(method.removeprefix("device-lag")), k_at, k, max_model_len,
                                 max_num_seqs, consensus_options)
    if package is None:
        import consensus_spec as package
    options = dict(consensus_options or {})
    if method == "consensus-nobudget":
        options["cost_model"] = "off"
    if method == "consensus-truth":
        if not str(options.get("cost_model", "")).endswith(".jsonl"):
            raise ValueError("consensus-truth needs the true table as its cost_model (a .jsonl)")
        options["online_costs"] = False
    if clock is None:
        options["online_costs"] = False
    p = package.ConsensusProposer(cfg, **options)
    if clock is not None:
        p.clock = clock
    return ProposerDrafter(p)
