"""Speculative configs for vLLM: ``LLM(model, speculative_config=consensus)``."""

from __future__ import annotations

from . import configured


def speculative_config(num_speculative_tokens: int = 8, **drafter_options) -> dict:
    """A ``speculative_config`` dict selecting the consensus proposer.

    ``drafter_options`` are fields of ``DrafterOptions``; they are validated
    here and carried to vLLM's engine process in the proposer's import path.
    """
    if int(num_speculative_tokens) < 1:
        raise ValueError("num_speculative_tokens must be >= 1")
    return {
        "method": "custom_class",
        "model": f"consensus_spec.configured.{configured.encode(drafter_options)}",
        "num_speculative_tokens": int(num_speculative_tokens),
    }


consensus = speculative_config()
