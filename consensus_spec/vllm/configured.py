"""Proposer classes with drafter options baked into their import path.

vLLM builds a custom proposer in its engine-core process from a dotted path
(``speculative_config.model``) and rejects unknown config keys, so options
travel in the class name: ``consensus_spec.vllm.configured.min_prob_0p4__max_depth_12``
is ``ConsensusProposer`` with ``min_prob=0.4, max_depth=12``. Floats write
``.`` as ``p`` and a leading ``-`` as ``m``; booleans are ``true``/``false``.

Prefer :func:`consensus_spec.engine_args`, which passes options in vLLM's
``additional_config``; this encoding serves ``speculative_config(**options)``.
"""

from __future__ import annotations

from dataclasses import fields

from ..drafting.drafter import DrafterOptions
from .options import ProposerOptions, engine_args, parse_options
from .proposer import ConsensusProposer

_FIELDS = {f.name: f.type for cls in (DrafterOptions, ProposerOptions) for f in fields(cls)}


def encode(options: dict) -> str:
    if not options:
        return "defaults"
    parse_options(options)  # fail here, not in the engine process
    parts = []
    for key in sorted(options):
        value = options[key]
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value).replace(".", "p").replace("-", "m").replace("+", "")
        elif isinstance(value, str) and value.isidentifier():
            text = value
        else:
            raise ValueError(f"option {key}={value!r} cannot travel in a class name; pass it "
                             "with consensus_spec.engine_args(...) (vLLM's additional_config)")
        parts.append(f"{key}_{text}")
    return "__".join(parts)


def speculative_config(num_speculative_tokens: int = 8, **options) -> dict:
    """A ``speculative_config`` dict selecting the consensus proposer, with
    ``options`` checked here and carried in the class name. Without options
    it equals :data:`consensus_spec.consensus`; :func:`consensus_spec.engine_args`
    carries options in ``additional_config`` instead (any value, paths too)."""
    spec = engine_args(num_speculative_tokens)["speculative_config"]
    if options:
        spec["model"] = f"{__name__}.{encode(options)}"
    return spec


def decode(name: str) -> dict:
    if name == "defaults":
        return {}
    options = {}
    for part in name.split("__"):
        key = next((k for k in _FIELDS if part.startswith(k + "_")), None)
        if key is None:
            raise AttributeError(f"unknown drafter option in {part!r}")
        text = part[len(key) + 1:]
        kind = _FIELDS[key]
        try:
            if kind in ("bool", bool):
                if text not in ("true", "false"):
                    raise ValueError(text)
                options[key] = text == "true"
            elif kind in ("int", int):
                options[key] = int(text.replace("m", "-"))
            elif kind in ("float", float):
                options[key] = float(text.replace("p", ".").replace("m", "-"))
            else:
                options[key] = text
        except ValueError:
            raise AttributeError(f"bad {kind} value {text!r} for drafter option {key!r}") from None
    return options


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    cls = type(f"ConsensusProposer_{name}", (ConsensusProposer,), {"options": decode(name)})
    globals()[name] = cls
    return cls
