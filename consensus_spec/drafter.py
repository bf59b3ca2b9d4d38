"""Sibling-consensus drafting over suffix tries, independent of any engine.

Paths that continue the same prompt form a sibling group sharing one trie
over the prompt (its tail) and every sibling's output, so a path drafts what
its siblings wrote after the same context, and its own prompt and history
when they offer nothing better. A second, cross-group trie over all recent
outputs is the other source, weighted below siblings.

All tries live in one compiled arena (:class:`SuffixForest`) so a step's
appends, and its drafts, are one call each for the whole batch. Memory stays
bounded however many paths pass: groups are forgotten least recently used,
the cross-group trie restarts beyond a token budget, and once the arena holds
``max_trie_nodes`` it is replaced by an empty one (live groups start afresh).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain
from dataclasses import dataclass, fields

import numpy as np

from .budget import cost_model
from .forest import SuffixForest


@dataclass(frozen=True)
class DrafterOptions:
    max_depth: int = 12             # longest context (tokens) matched in a trie
    min_prob: float = 0.05          # stop once P(this draft token accepted) < min_prob
    min_match: int = 1              # shortest context a draft may come from
    prior: float = 0.0              # pseudo-count added to each node's total
    cross_group_weight: float = 0.8  # other prompts' outputs count this much of siblings'
    prompt_tokens: int = 1024       # prompt tail indexed per group
    max_group_tokens: int = 400_000  # LRU budget over remembered groups
    cross_group_tokens: int = 600_000  # the cross-group trie restarts beyond this
    max_trie_nodes: int = 8_000_000  # arena size (~60 B a node) at which all tries start afresh
    cost_model: str = "h200_7b"     # step-cost model for the batch-aware budget, or "off"

    def __post_init__(self):
        if self.max_depth < 1 or self.min_match < 1 or self.min_match > self.max_depth:
            raise ValueError("need 1 <= min_match <= max_depth")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError("min_prob must be in [0, 1]")
        if self.prior < 0 or not 0.0 <= self.cross_group_weight <= 1.0:
            raise ValueError("prior must be >= 0 and cross_group_weight in [0, 1]")
        if min(self.prompt_tokens, self.max_group_tokens, self.cross_group_tokens) < 0:
            raise ValueError("token budgets must be >= 0")
        if self.max_trie_nodes < 1000:
            raise ValueError("max_trie_nodes must be >= 1000")
        cost_model(self.cost_model)  # validates the name

    @classmethod
    def from_dict(cls, options: dict) -> "DrafterOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown drafter option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)


class Group:
    __slots__ = ("prompt_tail", "root", "start", "tokens", "arena")

    def __init__(self, prompt_tail: list[int]):
        self.prompt_tail = prompt_tail
        self.arena = -1   # arena generation its nodes belong to
        self.root = self.start = -1
        self.tokens = 0


class Path:
    """One sampled path: where it stands in its group's and the cross-group trie."""

    __slots__ = ("group", "node", "cross_node", "arena", "cross_gen")

    def __init__(self, group: Group):
        self.group = group
        self.arena = self.cross_gen = -1
        self.node = self.cross_node = -1


def prompt_key(prompt) -> bytes:
    return np.asarray(prompt, dtype=np.int64).tobytes()


class ConsensusDrafter:
    def __init__(self, options: DrafterOptions | None = None):
        self.options = options or DrafterOptions()
        self._groups: OrderedDict[bytes, Group] = OrderedDict()
        self._group_tokens = 0
        self._arena = -1
        self._new_arena()

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def num_nodes(self) -> int:
        """Trie nodes held, for memory checks."""
        return self.forest.num_nodes()

    def add_path(self, prompt) -> Path:
        """Register a new path continuing ``prompt`` (token ids)."""
        key = prompt_key(prompt)
        group = self._groups.get(key)
        if group is None:
            n = self.options.prompt_tokens
            tail = np.asarray(prompt[len(prompt) - n:] if n else prompt[:0]).tolist()
            group = Group(tail)
            self._groups[key] = group
            self._group_tokens += len(tail)
            while self._group_tokens > self.options.max_group_tokens and len(self._groups) > 1:
                _, old = self._groups.popitem(last=False)
                self._group_tokens -= len(old.prompt_tail) + old.tokens
        else:
            self._groups.move_to_end(key)
        return Path(group)

    def extend(self, paths: list[Path], tokens: list[list[int]]) -> None:
        """Record the output tokens each path generated (one call per step)."""
        if self.forest.num_nodes() > self.options.max_trie_nodes:
            self._new_arena()
        self._attach_all(paths)
        rows = len(paths)
        counts = np.fromiter(map(len, tokens), np.int64, rows)
        flat = np.fromiter(chain.from_iterable(tokens), np.int32, int(counts.sum()))
        offsets = np.zeros(2 * rows + 1, np.int64)
        np.cumsum(np.concatenate([counts, counts]), out=offsets[1:])
        nodes = [p.node for p in paths] + [p.cross_node for p in paths]
        out = self.forest.extend_many(nodes, np.concatenate([flat, flat]), offsets).tolist()
        for path, node, cross_node, n in zip(paths, out, out[rows:], counts.tolist()):
            path.node = node
            path.cross_node = cross_node
            path.group.tokens += n
        self._group_tokens += len(flat)
        self._cross_tokens += len(flat)
        if self._cross_tokens > self.options.cross_group_tokens:
            self._cross_root, self._cross_gen = self.forest.new_root(), self._cross_gen + 1
            self._cross_tokens = 0

    def draft(self, paths: list[Path], max_tokens):
        """Most likely continuation of each path, at most ``max_tokens[i]``
        long, and the estimated chance that each prefix is accepted.

        Returns ``(tokens, probs, lengths)``: (R, k) arrays, row i valid up to
        ``lengths[i]``. Each token comes from whichever source (siblings, or
        all recent outputs at ``cross_group_weight``) scores higher on
        ``weight * P(token | context) * (1 + context length)``; a draft ends
        once the running product of the chosen probabilities drops below
        ``min_prob`` (see :func:`consensus_spec.trie.joint_draft`).
        """
        o = self.options
        self._attach_all(paths)
        cross = [p.cross_node for p in paths] if o.cross_group_weight > 0 else [-1] * len(paths)
        max_tokens = np.asarray(max_tokens, np.int32).reshape(len(paths))
        k = int(max_tokens.max(initial=0))
        return self.forest.draft_many([p.node for p in paths], cross, o.cross_group_weight,
                                      max_tokens, k, o.min_prob, o.min_match, o.prior)

    def _new_arena(self) -> None:
        self.forest = SuffixForest(self.options.max_depth)
        self._arena += 1
        self._cross_root, self._cross_gen, self._cross_tokens = self.forest.new_root(), 0, 0

    def _attach_all(self, paths: list[Path]) -> None:
        arena, gen = self._arena, self._cross_gen
        for path in paths:
            if path.arena != arena or path.cross_gen != gen:
                self._attach(path)

    def _attach(self, path: Path) -> None:
        """Give the path (and its group) nodes in the current arena."""
        group = path.group
        if group.arena != self._arena:
            group.root = self.forest.new_root()
            tail = np.asarray(group.prompt_tail, np.int32)
            group.start = int(self.forest.extend_many([group.root], tail, [0, len(tail)])[0])
            group.arena = self._arena
        stale = path.arena != self._arena
        if stale:
            path.node, path.arena = group.start, self._arena
        if stale or path.cross_gen != self._cross_gen:
            path.cross_node, path.cross_gen = self._cross_root, self._cross_gen
