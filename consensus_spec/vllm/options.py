"""Proposer options: validated where the user sets them, carried the vLLM way.

vLLM hands plugins their own settings through ``additional_config``:
``LLM(model, speculative_config=consensus, additional_config={"consensus_spec": {...}})``
or ``vllm serve ... --additional-config '{"consensus_spec": {...}}'``. The
proposer reads that section in vLLM's engine process. :func:`engine_args`
builds both keyword arguments after checking every option here, in the
calling process, so a typo or a wrong type is an error before any engine
starts rather than an engine that dies.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from ..budget import AUTO, cost_model
from ..device_route.options import RouteOptions
from ..drafting.drafter import DrafterOptions

SECTION = "consensus_spec"  # key of our options in vLLM's additional_config
PROPOSER_CLASS = "consensus_spec.ConsensusProposer"


@dataclass(frozen=True)
class ProposerOptions:
    """What the proposer does around the drafter: the draft budget's cost
    model and fault handling (drafting options are in :class:`DrafterOptions`)."""

    cost_model: str = AUTO  # the draft budget's step-cost model (see consensus_spec.budget), or "off"
    online_costs: bool = True  # learn step costs from timed steps, cost_model as the prior
    # cost_model=auto: keep what was learned per machine (model, dtype, device, TP/DP, vLLM
    # version) and start the next engine from it; step_costs_dir "" is the user's cache
    # ($CONSENSUS_SPEC_STEP_COSTS_DIR, else ~/.cache/consensus_spec/step_costs)
    remember_costs: bool = True
    step_costs_dir: str = ""
    warmup: bool = True   # compile and run the kernels at construction, not on the first request
    # back the trie arena's pages at start: a server's memory is the arena's bound
    # (arena_bytes) from the first request on, not growing to it over hours as it fills
    commit_arena: bool = True
    max_failures: int = 3  # failing steps in a row after which drafting is switched off

    def __post_init__(self):
        if self.max_failures < 1:
            raise ValueError("max_failures must be >= 1")
        if self.cost_model != AUTO:
            cost_model(self.cost_model)  # checks the name, reads and fits a table


_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
_KNOWN = {f.name: (cls, f.type) for cls in (DrafterOptions, ProposerOptions, RouteOptions)
          for f in fields(cls)}


def _check_type(key: str, value: Any, kind: str) -> None:
    allowed = _TYPES[kind]
    if isinstance(value, bool) and bool not in allowed:  # bool is an int in Python
        allowed = ()
    if not isinstance(value, allowed):
        raise TypeError(f"consensus_spec option {key}={value!r}: expected {kind}, "
                        f"got {type(value).__name__}")


def parse_options(options: Mapping[str, Any] | None) -> tuple[DrafterOptions, ProposerOptions]:
    """Both option sets from one flat mapping; unknown keys and wrong types
    are errors that name the option (the route's are checked, not returned)."""
    return split_options(options)[:2]


def split_options(options: Mapping[str, Any] | None
                  ) -> tuple[DrafterOptions, ProposerOptions, RouteOptions]:
    """The drafter's, the proposer's and the route's options from one flat mapping."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(_KNOWN))
    if unknown:
        raise ValueError(f"unknown consensus_spec option(s) {unknown}; known: {sorted(_KNOWN)}")
    split: dict[type, dict] = {DrafterOptions: {}, ProposerOptions: {}, RouteOptions: {}}
    for key, value in options.items():
        cls, kind = _KNOWN[key]
        _check_type(key, value, kind)
        split[cls][key] = value
    return (DrafterOptions(**split[DrafterOptions]), ProposerOptions(**split[ProposerOptions]),
            RouteOptions(**split[RouteOptions]))


def options_from_vllm(vllm_config) -> dict:
    """Our section of ``vllm_config.additional_config`` ({} when absent)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    section = extra.get(SECTION, {}) if isinstance(extra, Mapping) else {}
    if not isinstance(section, Mapping):
        raise TypeError(f"additional_config[{SECTION!r}] must be a JSON object, got {section!r}")
    return dict(section)


def engine_args(num_speculative_tokens: int = 8, **options) -> dict:
    """Keyword arguments for ``vllm.LLM`` (or ``AsyncEngineArgs``) that turn
    on consensus drafting with ``options``, checked here:
    ``LLM(model, **engine_args(max_depth=10, cost_model="costs.jsonl"))``."""
    if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) \
            or num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be an int >= 1, got {num_speculative_tokens!r}")
    parse_options(options)
    return {
        "speculative_config": {"method": "custom_class", "model": PROPOSER_CLASS,
                               "num_speculative_tokens": num_speculative_tokens},
        "additional_config": {SECTION: dict(options)},
    }


consensus = engine_args()["speculative_config"]
"""``LLM(model, speculative_config=consensus)``: consensus drafting, default options."""
