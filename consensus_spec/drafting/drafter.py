"""Sibling-consensus drafting over suffix tries, independent of any engine.

Paths that continue the same prompt form a sibling group sharing one trie
over the prompt (its tail) and every sibling's output, so a path drafts what
its siblings wrote after the same context, and its own prompt and history
when they offer nothing better. A second, cross-group trie over all recent
outputs is the other source, weighted below siblings.

All tries live in one compiled arena (:class:`SuffixForest`) so a step's
appends, and its drafts, are one call each for the whole batch. Memory stays
bounded however many paths pass, and no step ever pauses to free it:
released path ids are reused, groups are forgotten least recently used, the
cross-group trie restarts beyond a token budget, and the arena is two
halves that take turns (see :meth:`ConsensusDrafter._rotate`): new tries
start in the young half; once it is ``ROTATE_AT`` full, the old half is
dropped whole (an O(1) reset, not a compaction) and becomes the young one.
Tries in the dropped half are rebuilt from their prompt tail when next used.

The bound on each structure:

- per-path arrays (group, cursors): the most paths live at once, rounded up
  to a power of two. Released ids are reused, so this is the caller's
  bound: a path never released keeps its slot and its group live (the
  proposer's row tracker holds at most the batch plus its parked paths);
- remembered groups: ``max_group_tokens`` prompt tokens (LRU); a forgotten
  group lives on while it has live paths or its trie is in the arena;
- the arena: ``max_trie_nodes`` nodes (28 B each) and three edge tables
  (one per half and a spare; 16 B a slot, at least half as many slots
  as a half has nodes, each): about 40 B a node, allocated once and
  committed by the OS as first written; one entry per trie it holds in
  ``_owners``;
- one step's drafts and scratch (the forest's buffers, reused by every
  :meth:`~ConsensusDrafter.extend_and_draft`): the most rows and the
  longest draft seen, each rounded up to a power of two (12 B a row and
  draft token, 36 B more a row).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain
from dataclasses import dataclass, fields

import numpy as np

from .forest import UNSET, ForestFull, SuffixForest


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
    max_trie_nodes: int = 8_000_000  # arena size (~40 B a node), in two halves that take turns

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

    @classmethod
    def from_dict(cls, options: dict) -> "DrafterOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown drafter option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)


# The young half is retired (the old one dropped) once this full, so the
# retiring half keeps a quarter for its live paths' appends.
ROTATE_AT = 0.75
# The old half is dropped early, live groups and all, once this full.
OLD_FULL_AT = 0.95


class Group:
    __slots__ = ("prompt_tail", "prompt_len", "size", "root", "start", "live")

    def __init__(self, prompt_tail: np.ndarray, prompt_len: int):
        self.prompt_tail = prompt_tail
        self.prompt_len = prompt_len
        self.size = prompt_len + len(prompt_tail)  # tokens held (key and tail), for the LRU
        self.root = self.start = -1  # its trie's root and prompt-tail node; -1: no trie
        self.live = 0  # paths added and not released


def prompt_key(prompt) -> bytes:
    return np.asarray(prompt, dtype=np.int64).tobytes()


class ConsensusDrafter:
    """Paths are integer ids; their trie positions are rows of one cursor
    array, so a step touches no per-path Python object. A cursor is
    ``UNSET`` until the path is attached to the current tries, and again
    after the trie it points into is evicted or restarted."""

    def __init__(self, options: DrafterOptions | None = None):
        self.options = options or DrafterOptions()
        self._groups: OrderedDict[bytes, Group] = OrderedDict()
        self._group_tokens = 0
        self._path_group: list[Group | None] = []
        self._free: list[int] = []
        self._cursor = np.zeros((0, 2), np.int64)  # path -> (node in group trie, in cross trie)
        self._live_groups = 0  # groups with unreleased paths
        self.forest = SuffixForest(self.options.max_depth, self.options.max_trie_nodes)
        self._owners: dict[int, Group | None] = {}  # root -> its group (None: a cross-group trie)
        self._new_cross()
        self.evictions = 0       # halves dropped (rotations)
        self.groups_evicted = 0  # group tries dropped (forgotten ones included)
        self.live_groups_evicted = 0  # of those, groups with unreleased paths
        self.nodes_evicted = 0

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    @property
    def group_tokens(self) -> int:
        """Tokens the remembered groups hold (at most ``max_group_tokens``,
        or one group's alone)."""
        return self._group_tokens

    @property
    def num_paths(self) -> int:
        """Paths added and not released."""
        return len(self._path_group) - len(self._free)

    @property
    def num_live_groups(self) -> int:
        """Groups with paths added and not released (remembered or not)."""
        return self._live_groups

    @property
    def path_slots(self) -> int:
        """Rows of the per-path arrays: the most paths ever live at once,
        rounded up to a power of two, at least 64 (released ids are reused)."""
        return len(self._path_group)

    @property
    def num_tries(self) -> int:
        """Tries in the arena: groups' (until evicted) and cross-group ones
        (a restarted one stays, as garbage, until its half is dropped)."""
        return len(self._owners)

    @property
    def arena_bytes(self) -> int:
        """Bytes of the forest's arrays (nodes and edge tables) at full size."""
        return self.forest.nbytes

    def num_nodes(self) -> int:
        """Trie nodes held, for memory checks."""
        return self.forest.num_nodes()

    # Read-only views for a mirror of the tries (the device route's table).
    @property
    def cross_root(self) -> int:
        """Root of the cross-group trie paths draft from (-1: none)."""
        return self._cross_start()

    def path_group(self, path: int) -> Group | None:
        return self._path_group[path] if 0 <= path < len(self._path_group) else None

    def group_of_root(self, root: int) -> Group | None:
        """The group whose trie is rooted at ``root`` (None: none, or the cross-group trie)."""
        return self._owners.get(root)

    def cursors(self, paths) -> np.ndarray:
        """(R, 2) copy of the paths' (group trie, cross trie) nodes; ``UNSET``
        where not attached."""
        return self._cursor[np.asarray(paths, np.int64)].copy()

    def group_roots(self, paths, attach: bool = True) -> np.ndarray:
        """Each path's group trie root; with ``attach``, every path is first
        attached to the current tries (an evicted group trie is rebuilt), as
        drafting would; without, -1 marks a group with no trie."""
        paths = self._attached(paths) if attach else np.asarray(paths, np.int64).reshape(-1)
        return np.array([self._path_group[p].root for p in paths.tolist()], np.int64)

    def add_path(self, prompt) -> int:
        """Register a new path continuing ``prompt`` (token ids); returns its id."""
        key = prompt_key(prompt)
        group = self._groups.get(key)
        if group is None:
            n = self.options.prompt_tokens
            # an array, not a list: freeing hundreds of groups' tails as Python
            # ints took ~3 ms of a rotation
            tail = np.array(prompt[len(prompt) - n:] if n else prompt[:0], np.int32)
            group = Group(tail, len(prompt))
            self._groups[key] = group
            self._group_tokens += group.size
            while self._group_tokens > self.options.max_group_tokens and len(self._groups) > 1:
                _, old = self._groups.popitem(last=False)
                self._group_tokens -= old.size  # its trie is garbage once its paths finish
        else:
            self._groups.move_to_end(key)
        if not self._free:
            self._grow()
        path = self._free.pop()
        self._path_group[path] = group
        self._use(group, +1)
        self._make_room(tidy=False)  # once a step is enough: the extend call does it
        self._build(group)
        # a new path really continues the prompt: it starts after the prompt tail
        cursor = self._cursor
        cursor[path, 0] = group.start
        cursor[path, 1] = self._cross_start()
        return path

    def release(self, path: int) -> None:
        """Forget a finished path; its id may be reused."""
        if not 0 <= path < len(self._path_group) or self._path_group[path] is None:
            raise ValueError(f"no such path: {path}")
        self._use(self._path_group[path], -1)
        self._path_group[path] = None
        self._cursor[path] = UNSET
        self._free.append(path)

    def _use(self, group: Group, paths: int) -> None:
        self._live_groups += (group.live + paths > 0) - (group.live > 0)
        group.live += paths

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

        def extend():
            ids = self._attached(paths)
            self._cursor[ids] = self.forest.extend_rows(self._cursor[ids], buffer, rows, begins, ends)
        self._retrying(extend)

    def draft(self, paths, max_tokens):
        """Most likely continuation of each path, at most ``max_tokens[i]``
        long, and the estimated chance that each prefix is accepted.

        Returns ``(tokens, probs, lengths)``: (R, k) arrays, row i valid up to
        ``lengths[i]``. Each token comes from whichever source (siblings, or
        all recent outputs at ``cross_group_weight``) scores higher on
        ``weight * P(token | context) * (1 + context length)``; a draft ends
        once the running product of the chosen probabilities drops below
        ``min_prob`` (see :func:`tests.reference_trie.joint_draft`).
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
        ``min_prob`` raises the options' one for this call. The arrays
        returned are the forest's buffers: valid until the next call."""
        o = self.options
        self._make_room()
        floor = o.min_prob if min_prob is None else max(o.min_prob, min_prob)
        args = (buffer, rows, begins, ends, max_tokens,
                o.cross_group_weight, floor, o.min_match, o.prior)

        def extend_and_draft():
            out = self.forest.extend_and_draft(self._cursor, paths, *args)
            if out is None:  # some cursor is unset: attach, then go again
                out = self.forest.extend_and_draft(self._cursor, self._attached(paths), *args)
            return out
        return self._retrying(extend_and_draft)

    def _retrying(self, call, what: str = "one call appends"):
        """``call()``; when a half of the arena is full (a call bigger than
        the margin _make_room keeps), rotate and call again, twice at most."""
        for _ in range(3):
            try:
                return call()
            except ForestFull:
                self._rotate()
        raise ValueError(f"{what} more than half of max_trie_nodes can hold")

    def _make_room(self, tidy: bool = True) -> None:
        """Rotate the arena's halves, or restart the cross-group trie, once
        over budget; checked before each call, so a call never finds the
        arena full short of one bigger than a quarter of a half."""
        f = self.forest
        room = f.room(ROTATE_AT, OLD_FULL_AT)
        if tidy:
            f.tidy(young_half_full=bool(room & 2))
        if room & 1:
            self._rotate()
        elif f.tokens_appended - self._cross_since > self.options.cross_group_tokens:
            self._new_cross()  # the old trie stays, as garbage, until its half is dropped

    def _rotate(self) -> None:
        """Drop the old half of the arena whole and start new tries there,
        the cross-group trie's among them. The dropped tries were started a
        half's worth of appends ago: garbage and idle groups, as a rule; a
        group still live in it (a very long generation) loses its trie, and
        its paths re-attach at the root of a new one (see _attach).
        O(tries + paths) in Python, no pass over the nodes."""
        f = self.forest
        dropped = f.old
        self.nodes_evicted += f.num_nodes(dropped)
        f.rotate()
        lo, hi = dropped * f.half, (dropped + 1) * f.half
        for root in [r for r in self._owners if lo <= r < hi]:
            group = self._owners.pop(root)
            if group is not None:
                group.root = group.start = -1
                self.groups_evicted += 1
                self.live_groups_evicted += group.live > 0
        cursor = self._cursor
        cursor[(cursor >= lo) & (cursor < hi)] = UNSET
        self.evictions += 1
        # The cross-group trie takes every path's tokens: left in the old half
        # it would fill it and drop that half's live groups early.
        self._new_cross()

    def drop_tries(self) -> None:
        """Start every trie afresh (a new arena), keeping paths and their
        groups: after a failure that may have left the tries inconsistent,
        siblings still in flight share a group again from the next call."""
        self.forest = SuffixForest(self.options.max_depth, self.options.max_trie_nodes)
        for group in self._owners.values():
            if group is not None:
                group.root = group.start = -1
        self._owners = {}
        self._cursor[:] = UNSET
        self._new_cross()

    def restore(self, paths, buffer, rows, ends, max_tokens: int = 4096) -> None:
        """Re-append what paths wrote, after :meth:`drop_tries`: path
        ``paths[i]``'s sequence is ``buffer[rows[i], :ends[i]]``, its group's
        prompt followed by its output; at most the last ``max_tokens`` of
        the output go in (from the trie's root if that is not all of it,
        so no n-gram that never occurred is recorded). Whole outputs matter:
        keeping only the last 256 tokens left tau 5-6% below a clean run
        for the next 50 steps (``python -m evals faults``)."""
        paths = self._attached(paths)  # rebuilds each group's trie from its prompt tail
        rows, ends = np.asarray(rows, np.int64), np.asarray(ends, np.int64)
        begins = np.empty_like(ends)
        for j, path in enumerate(paths.tolist()):
            group = self._path_group[path]
            begins[j] = max(group.prompt_len, int(ends[j]) - max_tokens)
            if begins[j] == group.prompt_len:  # the whole output: it does follow the prompt
                self._cursor[path, 0] = group.start
        self.extend_from(paths, buffer, rows, np.minimum(begins, ends), ends)

    def _attached(self, paths) -> np.ndarray:
        """Checked path ids, each with a cursor into the current tries."""
        paths = np.asarray(paths, np.int64).reshape(-1)
        if paths.size and (paths.min() < 0 or paths.max() >= len(self._path_group)):
            raise ValueError("unknown path id")
        for _ in range(3):  # a rotation while attaching unsets cursors again
            cursor = self._cursor[paths]
            unset = paths[(cursor[:, 0] == UNSET) | (cursor[:, 1] == UNSET)].tolist()
            rotations = self.evictions
            for path in unset:
                self._attach(path)
            if rotations == self.evictions:
                return paths
        raise ValueError("paths keep losing their tries: max_trie_nodes is too small")

    def _grow(self) -> None:
        old = len(self._path_group)
        new = max(64, 2 * old)
        self._path_group.extend([None] * (new - old))
        self._free.extend(range(new - 1, old - 1, -1))  # lowest id first
        cursor = np.full((new, 2), UNSET, np.int64)
        cursor[:old] = self._cursor
        self._cursor = cursor

    def _new_cross(self) -> None:
        """Start a new cross-group trie; paths re-attach to it when next used."""
        self._cross_root, self._cross_since = self._new_root(), self.forest.tokens_appended
        self._owners[self._cross_root] = None
        self._cursor[self._cursor[:, 1] >= 0, 1] = UNSET

    def _cross_start(self) -> int:
        return self._cross_root if self.options.cross_group_weight > 0 else -1

    def _build(self, group: Group) -> None:
        """Give the group a trie holding its prompt tail, if it has none."""
        if group.root < 0:
            tail = group.prompt_tail

            def build():  # a root left empty by a full half is garbage in it
                root = self._new_root()
                return root, int(self.forest.extend_many([root], tail, [0, len(tail)])[0])
            group.root, group.start = self._retrying(build, "a prompt tail needs")
            self._owners[group.root] = group

    def _new_root(self) -> int:
        try:
            return self.forest.new_root()
        except ForestFull:
            self._rotate()
            return self.forest.new_root()

    def _attach(self, path: int) -> None:
        """Point the path's unset cursors into the current tries. A cursor is
        unset mid-path (its trie was evicted or restarted), so it restarts at
        the trie's root with no context: appending there records only
        n-grams of the path's own output, never the prompt followed by
        whatever the path writes now."""
        group = self._path_group[path]
        if group is None:
            raise ValueError(f"path {path} was released")
        if self._cursor[path, 0] == UNSET:
            self._build(group)
            self._cursor[path, 0] = group.root
        if self._cursor[path, 1] == UNSET:
            self._cursor[path, 1] = self._cross_start()
