"""Speculative configs for vLLM: ``LLM(model, speculative_config=consensus)``."""

from __future__ import annotations

from . import configured
from .options import PROPOSER_CLASS, engine_args, parse_options

__all__ = ["consensus", "engine_args", "speculative_config"]


def speculative_config(num_speculative_tokens: int = 8, **options) -> dict:
    """A ``speculative_config`` dict selecting the consensus proposer.

    Options are checked here. Without options this is :data:`consensus`.
    With options, they travel to vLLM's engine process in the proposer's
    class name (see :mod:`consensus_spec.configured`); :func:`engine_args`
    carries them in ``additional_config`` instead, which vLLM intends for
    plugins and which takes any value, a cost-table path too.
    """
    spec = engine_args(num_speculative_tokens)["speculative_config"]
    if options:
        parse_options(options)
        spec["model"] = f"consensus_spec.configured.{configured.encode(options)}"
    return spec


consensus = {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": 8}
