"""Sibling-consensus drafting over suffix tries, independent of any engine.

Paths that continue the same prompt form a sibling group sharing one trie
over the prompt (its tail) and every sibling's output, so a path drafts what
its siblings wrote after the same context, and its own prompt and history
when they offer nothing better. A second, cross-group trie over all recent
outputs is the other source, weighted below siblings.

All tries live in one compiled arena (:class:`SuffixForest`) so a step's
appends, and its drafts, are one call each for the whole batch. Memory stays
bounded however many paths pass: released path ids are reused, groups are
forgotten least recently used, the cross-group trie restarts beyond a token
budget, and once the arena holds ``max_trie_nodes`` it is emptied (live
groups start afresh).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain
from dataclasses import dataclass, fields

import numpy as np

from .budget import AUTO, cost_model
from .forest import UNSET, SuffixForest


@dataclass(frozen=True)
class DrafterOptions:
    max_depth: int = 8              # longest context (tokens) matched in a trie
    min_prob: float = 0.05          # stop once P(this draft token accepted) < min_prob
    min_match: int = 1              # shortest context a draft may come from
    prior: float = 0.5              # pseudo-count added to node totals: few sightings weigh less
    cross_group_weight: float = 0.8  # other prompts' outputs count this much of siblings'
    prompt_tokens: int = 512        # prompt tail indexed per group
    max_group_tokens: int = 400_000  # prompt tokens of remembered groups (LRU)
    cross_group_tokens: int = 600_000  # the cross-group trie restarts beyond this
    max_trie_nodes: int = 8_000_000  # arena size (~40 B a node) at which all tries start afresh
    cost_model: str = "auto"        # step-cost model for the budget (see budget.py), or "off"

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
        if self.cost_model != AUTO:
            cost_model(self.cost_model)  # validates the name (and reads a table)

    @classmethod
    def from_dict(cls, options: dict) -> "DrafterOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown drafter option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)


class Group:
    __slots__ = ("prompt_tail", "size", "root", "start", "arena")

    def __init__(self, prompt_tail: list[int], size: int):
        self.prompt_tail = prompt_tail
        self.size = size  # prompt tokens it holds (key and tail), for the LRU budget
        self.arena = -1   # arena generation its nodes belong to
        self.root = self.start = -1


def prompt_key(prompt) -> bytes:
    return np.asarray(prompt, dtype=np.int64).tobytes()


class ConsensusDrafter:
    """Paths are integer ids; their trie positions are rows of one cursor
    array, so a step touches no per-path Python object. A cursor is
    ``UNSET`` until the path is attached to the current tries, and again
    after the tries it points into are emptied or restarted."""

    def __init__(self, options: DrafterOptions | None = None):
        self.options = options or DrafterOptions()
        self._groups: OrderedDict[bytes, Group] = OrderedDict()
        self._group_tokens = 0
        self._path_group: list[Group | None] = []
        self._free: list[int] = []
        self._cursor = np.zeros((0, 2), np.int64)  # path -> (node in group trie, in cross trie)
        self.forest = None
        self._arena = -1
        self._new_arena()

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    @property
    def num_paths(self) -> int:
        """Paths added and not released."""
        return len(self._path_group) - len(self._free)

    def num_nodes(self) -> int:
        """Trie nodes held, for memory checks."""
        return self.forest.num_nodes()

    def add_path(self, prompt) -> int:
        """Register a new path continuing ``prompt`` (token ids); returns its id."""
        key = prompt_key(prompt)
        group = self._groups.get(key)
        if group is None:
            n = self.options.prompt_tokens
            tail = np.asarray(prompt[len(prompt) - n:] if n else prompt[:0]).tolist()
            group = Group(tail, len(prompt) + len(tail))
            self._groups[key] = group
            self._group_tokens += group.size
            while self._group_tokens > self.options.max_group_tokens and len(self._groups) > 1:
                _, old = self._groups.popitem(last=False)
                self._group_tokens -= old.size
        else:
            self._groups.move_to_end(key)
        if not self._free:
            self._grow()
        path = self._free.pop()
        self._path_group[path] = group
        self._cursor[path] = UNSET
        self._attach(path)
        return path

    def release(self, path: int) -> None:
        """Forget a finished path; its id may be reused."""
        if not 0 <= path < len(self._path_group) or self._path_group[path] is None:
            raise ValueError(f"no such path: {path}")
        self._path_group[path] = None
        self._cursor[path] = UNSET
        self._free.append(path)

    def extend(self, paths, tokens: list[list[int]]) -> None:
        """Record the output tokens each path generated (one call per step)."""
        counts = np.fromiter(map(len, tokens), np.int64, len(tokens))
        flat = np.fromiter(chain.from_iterable(tokens), np.int64, int(counts.sum()))
        ends = np.cumsum(counts)
        self.extend_from(paths, flat.reshape(1, -1), np.zeros(len(counts), np.int64),
                         ends - counts, ends)

    def extend_from(self, paths, buffer, rows, begins, ends) -> None:
        """Like :meth:`extend`, path ``paths[i]`` taking
        ``buffer[rows[i], begins[i]:ends[i]]`` from a 2-D token array."""
        self._make_room()
        paths = self._attached(paths)
        self._cursor[paths] = self.forest.extend_rows(self._cursor[paths], buffer, rows, begins, ends)

    def draft(self, paths, max_tokens):
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
        paths = self._attached(paths)
        max_tokens = np.asarray(max_tokens, np.int32).reshape(len(paths))
        k = int(max_tokens.max(initial=0))
        cursor = self._cursor[paths]
        return self.forest.draft_many(cursor[:, 0], cursor[:, 1], o.cross_group_weight,
                                      max_tokens, k, o.min_prob, o.min_match, o.prior)

    def extend_and_draft(self, paths, buffer, rows, begins, ends, max_tokens, min_prob=None):
        """:meth:`extend_from` then :meth:`draft`, in one compiled call;
        ``min_prob`` raises the options' one for this call."""
        o = self.options
        self._make_room()
        floor = o.min_prob if min_prob is None else max(o.min_prob, min_prob)
        args = (buffer, rows, begins, ends, max_tokens,
                o.cross_group_weight, floor, o.min_match, o.prior)
        out = self.forest.extend_and_draft(self._cursor, paths, *args)
        if out is None:  # some cursor is unset: attach, then go again
            out = self.forest.extend_and_draft(self._cursor, self._attached(paths), *args)
        return out

    def _make_room(self) -> None:
        """Empty the arena, or restart the cross-group trie, once over budget."""
        if self.forest.num_nodes() > self.options.max_trie_nodes:
            self._new_arena()
        elif self.forest.tokens_appended - self._cross_since > self.options.cross_group_tokens:
            self._cross_root = self.forest.new_root()
            self._cross_since = self.forest.tokens_appended
            self._cursor[self._cursor[:, 1] >= 0, 1] = UNSET

    def _attached(self, paths) -> np.ndarray:
        """Checked path ids, each with a cursor into the current tries."""
        paths = np.asarray(paths, np.int64).reshape(-1)
        if paths.size and (paths.min() < 0 or paths.max() >= len(self._path_group)):
            raise ValueError("unknown path id")
        cursor = self._cursor[paths]
        for path in paths[(cursor[:, 0] == UNSET) | (cursor[:, 1] == UNSET)].tolist():
            self._attach(path)
        return paths

    def _grow(self) -> None:
        old = len(self._path_group)
        new = max(64, 2 * old)
        self._path_group.extend([None] * (new - old))
        self._free.extend(range(new - 1, old - 1, -1))  # lowest id first
        cursor = np.full((new, 2), UNSET, np.int64)
        cursor[:old] = self._cursor
        self._cursor = cursor

    def _new_arena(self) -> None:
        if self.forest is None:
            self.forest = SuffixForest(self.options.max_depth)
        else:
            self.forest.clear()
        self._arena += 1
        self._cursor[:] = UNSET
        self._cross_root, self._cross_since = self.forest.new_root(), self.forest.tokens_appended

    def _attach(self, path: int) -> None:
        """Point the path's unset cursors (and its group) into the current tries."""
        group = self._path_group[path]
        if group is None:
            raise ValueError(f"path {path} was released")
        if group.arena != self._arena:
            group.root = self.forest.new_root()
            tail = np.asarray(group.prompt_tail, np.int32)
            group.start = int(self.forest.extend_many([group.root], tail, [0, len(tail)])[0])
            group.arena = self._arena
        if self._cursor[path, 0] == UNSET:
            self._cursor[path, 0] = group.start
        if self._cursor[path, 1] == UNSET:
            self._cursor[path, 1] = self._cross_root if self.options.cross_group_weight > 0 else -1
