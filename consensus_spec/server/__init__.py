"""HTTP rooms over :mod:`consensus_spec.sampling` on vLLM's OpenAI server:
``POST /v1/self_consistency`` (:mod:`.endpoint`, request and response in
:mod:`.protocol`), its OpenAI-shaped routes ``/v1/self_consistency/completions``
and ``/v1/self_consistency/chat/completions`` (:mod:`.openai_routes`,
:mod:`.openai_protocol`), the options they share (:mod:`.options`), how
they run (:mod:`.runs`) and the engine's step cost they start waves by
(:mod:`.step_costs`)."""

PLUGIN_NAME = "consensus_spec_self_consistency"  # the entry points' name: VLLM_PLUGINS names it
ROUTE = "/v1/self_consistency"
