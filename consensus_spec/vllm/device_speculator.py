"""Consensus drafting on vLLM's Model Runner V2, async scheduling kept
(experimental): a thin speculator over :mod:`consensus_spec.device_route`.

V2 builds its n-gram speculator through ``init_speculator``, which imports
``NgramGPUSpeculator`` from its module when called. :func:`register` (a
``vllm.general_plugins`` entry point, so it runs in every vLLM process
before a runner is built; on CUDA platforms only) probes that slot and the
state the speculator reads; only if every probe passes does it replace that
module attribute with
a factory that builds :class:`ConsensusDeviceSpeculator` when
``additional_config["consensus_spec"]["route"] == "device"`` and vLLM's own
class otherwise. On any failed probe it logs one WARNING and leaves vLLM
untouched. Configure with :func:`device_engine_args`.

The speculator never raises into the runner: a failing step logs, drafts
fill tokens (each row's last token, as vLLM's n-gram speculator fills a
miss; verification rejects them, so outputs are unchanged), and starts the
route's state afresh; after ``max_failures`` failing steps in a row it
drafts only fill tokens for the engine's life.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from functools import lru_cache
from typing import Any

from ..device_route.options import RouteOptions
from .options import SECTION, options_from_vllm, split_options

logger = logging.getLogger(f"vllm.{__name__}")

TESTED_VERSIONS = ("0.32.",)
ANY_VERSION_ENV = "CONSENSUS_SPEC_DEVICE_ROUTE_ANY_VERSION"  # "1": try on untested versions
SLOT = "vllm.v1.worker.gpu.spec_decode.ngram.speculator"
PROPOSE_PARAMS = ("input_batch", "attn_metadata", "slot_mappings", "last_hidden_states",
                  "aux_hidden_states", "num_sampled", "num_rejected", "last_sampled",
                  "next_prefill_tokens", "temperature", "seeds", "dummy_run",
                  "num_speculative_tokens")
_installed: list = []  # vLLM's class, once replaced in this process


def device_engine_args(schedule, max_depth: int = 8, **options) -> dict:
    """Keyword arguments for ``vllm.LLM`` (Model Runner V2) that run the
    device route: ``schedule`` is vLLM's ``num_speculative_tokens_per_batch_size``
    (``[[1, 16, 6], [17, 64, 1], [65, 128, 1]]``), K per batch size."""
    section = {"route": "device", "max_depth": max_depth, **options}
    split_options(section)  # checked here, not in the engine
    k = max(int(e[2]) for e in schedule)
    return {"speculative_config": {"method": "ngram_gpu", "num_speculative_tokens": k,
                                   "prompt_lookup_min": 1, "prompt_lookup_max": max_depth,
                                   "num_speculative_tokens_per_batch_size": [list(e) for e in schedule]},
            "additional_config": {SECTION: section}}


# -- probes ----------------------------------------------------------------

def probes() -> list[tuple[str, bool]]:
    """(what, holds) for each fact about this vLLM the route relies on."""
    import dataclasses
    import typing

    import vllm
    from vllm.config import speculative as spec_config
    from vllm.config import vllm as vllm_config_module
    from vllm.v1.worker.gpu import input_batch, spec_decode, states
    from vllm.v1.worker.gpu.spec_decode import speculator

    version = getattr(vllm, "__version__", "")
    init_src = inspect.getsource(spec_decode.init_speculator)
    slot = __import__(SLOT, fromlist=["NgramGPUSpeculator"])
    params = inspect.signature(speculator.BaseSpeculator.propose).parameters
    state_src = inspect.getsource(states.RequestState.__init__)
    add_params = inspect.signature(states.RequestState.add_request).parameters
    batch_fields = {f.name for f in dataclasses.fields(input_batch.InputBatch)}
    v2_src = inspect.getsource(vllm_config_module.VllmConfig._get_v2_model_runner_unsupported_features)
    return [
        (f"vLLM {version} is a tested version {TESTED_VERSIONS} (or {ANY_VERSION_ENV}=1)",
         version.startswith(TESTED_VERSIONS) or os.environ.get(ANY_VERSION_ENV) == "1"),
        ("init_speculator imports NgramGPUSpeculator lazily and passes req_states",
         f"from {SLOT} import" in init_src
         and "NgramGPUSpeculator(vllm_config, device, req_states)" in init_src
         and hasattr(slot, "NgramGPUSpeculator")),
        ("BaseSpeculator.propose has the expected parameters",
         all(p in params for p in PROPOSE_PARAMS)),
        ("BaseSpeculator's abstract methods are init_cudagraph_manager, capture, propose",
         set(speculator.BaseSpeculator.__abstractmethods__)
         == {"init_cudagraph_manager", "capture", "propose"}),
        ("RequestState holds all_token_ids, prompt_len, total_len, last_sampled_tokens",
         all(re.search(rf"self\.{a}\s*(:[^=\n]*)?=", state_src) for a in
             ("all_token_ids", "prompt_len", "total_len", "last_sampled_tokens", "req_id_to_index"))
         and all(p in add_params for p in ("req_id", "prompt_len", "all_token_ids"))),
        ("InputBatch has req_ids, idx_mapping, idx_mapping_np, num_reqs",
         {"req_ids", "idx_mapping", "idx_mapping_np", "num_reqs"} <= batch_fields),
        ("ngram_gpu keeps async scheduling and Model Runner V2",
         "ngram_gpu" in typing.get_args(spec_config.NgramGPUTypes)
         and '"ngram_gpu"' not in v2_src
         and "not in get_args(NgramGPUTypes)" in inspect.getsource(vllm_config_module)),
    ]


def register() -> bool:
    """vLLM general-plugin hook (every vLLM process): on a CUDA platform,
    :func:`install`; elsewhere Model Runner V2 cannot run and nothing is
    touched. Never raises."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            logger.debug("consensus_spec: device route not installed (not a CUDA platform)")
            return False
    except Exception:  # noqa: BLE001 - vLLM absent or too different
        return False
    return install()


def install() -> bool:
    """Take the ngram slot if every probe passes; else one WARNING and vLLM
    untouched. Idempotent; never raises. Returns whether it is taken."""
    if _installed:
        return True
    try:
        failed = [what for what, holds in probes() if not holds]
    except Exception as e:  # noqa: BLE001 - vLLM too different to probe
        failed = [f"probing failed ({type(e).__name__}: {e})"]
    if failed:
        logger.warning("consensus_spec: device route not installed, vLLM left untouched (%s); "
                       "route='device' runs vLLM's ngram_gpu instead", "; ".join(failed))
        return False
    try:
        slot = __import__(SLOT, fromlist=["NgramGPUSpeculator"])
        original = slot.NgramGPUSpeculator
        slot.NgramGPUSpeculator = _factory(original)
        _installed.append(original)
    except Exception as e:  # noqa: BLE001
        logger.warning("consensus_spec: device route not installed (%s)", e)
        return False
    logger.info("consensus_spec: %s.NgramGPUSpeculator now builds the consensus device route "
                "where additional_config sets route='device' (vLLM's class otherwise)", SLOT)
    return True


def _factory(original):
    def NgramGPUSpeculator(vllm_config, device, req_states):  # noqa: N802 - stands in for the class
        section = options_from_vllm(vllm_config)
        if section.get("route") == "device":
            return speculator_class()(vllm_config, device, req_states)
        return original(vllm_config, device, req_states)

    NgramGPUSpeculator._consensus_spec_original = original
    return NgramGPUSpeculator


# -- the speculator --------------------------------------------------------

@lru_cache(maxsize=None)
def speculator_class():
    """:class:`ConsensusDeviceSpeculator` (built on first use: it subclasses
    vLLM's ``BaseSpeculator``, and vLLM is imported only inside functions here)."""
    import torch
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

    from ..device_route.route import DeviceRoute

    class ConsensusDeviceSpeculator(BaseSpeculator):
        supports_mm_inputs = False
        draft_logits = None

        def __init__(self, vllm_config, device, req_states):
            spec = vllm_config.speculative_config
            self.num_speculative_steps = int(spec.num_speculative_tokens)
            self.max_num_reqs = int(vllm_config.scheduler_config.max_num_seqs)
            self.device = torch.device(device)
            self.req_states = req_states
            self.drafter_options, proposer, route = split_options(options_from_vllm(vllm_config))
            self.route_options = route if route.route == "device" else RouteOptions("device")
            self.max_failures = proposer.max_failures
            self.drafts = torch.zeros((self.max_num_reqs, self.num_speculative_steps),
                                      dtype=torch.int64, device=self.device)
            self.num_failures = self._failing = 0
            self.disabled = False
            self._prompts: dict[str, tuple[list, list]] = {}
            self._capture_prompts(req_states)
            self._new_route()
            logger.info("consensus_spec device route: lag %d, K <= %d, %s",
                        self.route_options.lag, self.num_speculative_steps, self.drafter_options)

        def _new_route(self) -> None:
            self.route = DeviceRoute(self.drafter_options, self.route_options, self.max_num_reqs,
                                     self.num_speculative_steps + 1, self.device)

        def _capture_prompts(self, req_states) -> None:
            """The runner hands ``add_request`` each new request's tokens as
            a host list: keep the prompt (and, for a resumed request, what it
            wrote) from there rather than copying it back from the device."""
            add_request = req_states.add_request

            def add(req_id, prompt_len, all_token_ids, *args, **kwargs):
                add_request(req_id, prompt_len, all_token_ids, *args, **kwargs)
                self._prompts[req_id] = (list(all_token_ids[:prompt_len]),
                                         list(all_token_ids[prompt_len:]))
            req_states.add_request = add

        def _prompt_of(self, req_id: str):
            got = self._prompts.pop(req_id, None)
            if got is not None:
                return got
            rs = self.req_states  # not seen being added: read it back (a sync, once per request)
            slot = rs.req_id_to_index[req_id]
            n, m = int(rs.prompt_len.np[slot]), int(rs.prefill_len.np[slot])
            row = rs.all_token_ids.gpu[slot, :m].tolist()
            return row[:n], row[n:]

        def init_cudagraph_manager(self, cudagraph_mode) -> None:
            del cudagraph_mode

        def capture(self) -> None:
            return None

        @torch.inference_mode()
        def propose(self, input_batch, attn_metadata: Any, slot_mappings: Any,
                    last_hidden_states, aux_hidden_states, num_sampled, num_rejected,
                    last_sampled, next_prefill_tokens, temperature, seeds, dp_sync_state=None,
                    dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                    mm_inputs=None, is_profile: bool = False, num_speculative_tokens=None):
            num_reqs = input_batch.num_reqs
            if dummy_run:
                return self.drafts[:num_reqs]
            k = self.num_speculative_steps if num_speculative_tokens is None \
                else min(int(num_speculative_tokens), self.num_speculative_steps)
            if not self.disabled:
                try:
                    rs = self.req_states
                    drafts = self.route.step(
                        input_batch.req_ids[:num_reqs], rs.req_id_to_index.__contains__,
                        self._prompt_of, input_batch.idx_mapping[:num_reqs],
                        rs.all_token_ids.gpu, rs.total_len.gpu, num_sampled[:num_reqs], k)
                    self.drafts[:num_reqs, :k] = drafts
                    self._failing = 0
                    if len(self._prompts) > 4 * self.max_num_reqs:  # added, never scheduled
                        self._prompts = {r: p for r, p in self._prompts.items()
                                         if r in rs.req_id_to_index}
                    return self.drafts[:num_reqs]
                except Exception as error:  # noqa: BLE001 - never take the engine down
                    self._contain(error)
            try:
                fill = last_sampled[input_batch.idx_mapping[:num_reqs]].view(num_reqs, 1)
                self.drafts[:num_reqs, :k] = fill
            except Exception:  # noqa: BLE001 - stale drafts are still only drafts
                pass
            return self.drafts[:num_reqs]

        def _contain(self, error: Exception) -> None:
            self.num_failures += 1
            self._failing += 1
            logger.warning("consensus_spec device route: step failed (%s: %s); fill tokens this "
                           "step, route state reset (failure %d, %d in a row)",
                           type(error).__name__, error, self.num_failures, self._failing,
                           exc_info=self.num_failures == 1)
            if self._failing >= self.max_failures:
                self.disabled = True
                logger.error("consensus_spec device route: %d steps failed in a row; drafting "
                             "off for this engine's life (outputs are unaffected)", self._failing)
                return
            try:
                self._new_route()
            except Exception:  # noqa: BLE001
                self.disabled = True
                logger.error("consensus_spec device route: state could not be rebuilt; "
                             "drafting off", exc_info=True)

        def stats(self) -> dict:
            return {**self.route.stats(), "num_failures": self.num_failures,
                    "disabled": self.disabled}

    return ConsensusDeviceSpeculator
