"""Options of the device route (no torch here: the options are checked
where the user sets them)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..drafting.drafter import DrafterOptions

ROUTES = ("host", "device")


@dataclass(frozen=True)
class RouteOptions:
    route: str = "host"              # "device": Model Runner V2's speculator slot (experimental)
    lag: int = 1                     # calls between a token's step and its append to the tries
    cross_entries: int = 4_000_000   # cap on the device table's shared (cross-group) part

    def __post_init__(self):
        if self.route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {self.route!r}")
        if not 0 <= self.lag <= 8:
            raise ValueError("lag must be in 0..8")
        if self.cross_entries < 10_000:
            raise ValueError("cross_entries must be >= 10000")


def drafter_options(options: DrafterOptions, route: RouteOptions, max_rows: int,
                    max_tokens: int) -> DrafterOptions:
    """The drafter options the route runs with: the cross-group trie restarts
    before its part of the table could pass ``route.cross_entries``. A token
    adds at most ``max_depth`` nodes to a trie, and the restart is checked
    before each append of at most ``max_rows * max_tokens`` tokens."""
    budget = route.cross_entries // options.max_depth - max_rows * max_tokens - 1
    if budget < 1:
        raise ValueError("cross_entries too small for this batch size")
    return replace(options, cross_group_tokens=min(options.cross_group_tokens, budget))
