"""Where options once travelled in proposer class names (0.1's
``speculative_config(**options)``). That channel is gone: options go in
vLLM's ``additional_config`` (:func:`consensus_spec.engine_args`,
``--additional-config '{"consensus_spec": {...}}'``). vLLM still imports an
old config's class path from here, so every such name is a clear error that
says what to write instead.
"""

from __future__ import annotations

REMOVED = ("options in the proposer's class name are no longer read. Use "
           "speculative_config=consensus_spec.consensus (no options), "
           "LLM(model, **consensus_spec.engine_args(num_speculative_tokens=8, OPTION=VALUE, ...)), "
           "or for a server --speculative-config '{\"method\": \"custom_class\", \"model\": "
           "\"consensus_spec.ConsensusProposer\", \"num_speculative_tokens\": 8}' "
           "--additional-config '{\"consensus_spec\": {\"OPTION\": VALUE}}'")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"consensus_spec.vllm.configured.{name}: {REMOVED}")
