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

- per-path arrays (group, cursors: 24 B a path): the most paths live at
  once, rounded up to a power of two. Released ids are reused, so this is
  the caller's bound: a path never released keeps its slot and its group
  live (the proposer's row tracker holds at most the batch plus its parked
  paths);
- remembered groups: ``max_group_tokens`` prompt tokens (LRU); a forgotten
  group lives on while it has live paths or its trie is in the arena. Each
  group is a row of arrays (:mod:`.path_kernels`: 72 B, two table slots) and
  its prompt tail (4 B a token), rows grown by doubling to the most groups
  held at once;
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

import time
from itertools import chain
from dataclasses import dataclass, fields

import numpy as np

from . import path_kernels as R
from .paths import OLD_FULL_AT, ROTATE_AT, PathRegistry  # noqa: F401  (their home is paths)
from .forest import UNSET, ForestFull, SuffixForest

ndarray = np.ndarray
_I64 = np.dtype(np.int64)  # the one int64 dtype object numpy gives native arrays


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


class ConsensusDrafter(PathRegistry):
    """Paths are integer ids; their trie positions are rows of one cursor
    array, so a step touches no per-path Python object. A cursor is
    ``UNSET`` until the path is attached to the current tries, and again
    after the trie it points into is evicted or restarted. Paths and groups
    are registered in arrays (:class:`~.paths.PathRegistry`)."""

    def __init__(self, options: DrafterOptions | None = None):
        self.options = options or DrafterOptions()
        self.forest = SuffixForest(self.options.max_depth, self.options.max_trie_nodes)
        super().__init__()
        self._cross_roots: list[int] = []  # cross-group tries in the arena (the last is current)
        self._new_cross()
        self.evictions = 0       # halves dropped (rotations)
        self.groups_evicted = 0  # group tries dropped (forgotten ones included)
        self.live_groups_evicted = 0  # of those, groups with unreleased paths
        self.nodes_evicted = 0
        # what the rotations took, summed, and the longest (wall): an eviction is a
        # pause inside one step, so its worst case is what a server's tail sees
        self.eviction_s = self.eviction_cpu_s = self.eviction_max_s = 0.0

    @property
    def num_tries(self) -> int:
        """Tries in the arena: groups' (until evicted) and cross-group ones
        (a restarted one stays, as garbage, until its half is dropped)."""
        held = (self._groups[:, R.STATE] != R.FREE_ROW) & (self._groups[:, R.ROOT] >= 0)
        return int(np.count_nonzero(held)) + len(self._cross_roots)

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

    def cursors(self, paths) -> np.ndarray:
        """(R, 2) copy of the paths' (group trie, cross trie) nodes; ``UNSET``
        where not attached."""
        return self._cursor[np.asarray(paths, np.int64)].copy()

    def group_roots(self, paths, attach: bool = True) -> np.ndarray:
        """Each path's group trie root; with ``attach``, every path is first
        attached to the current tries (an evicted group trie is rebuilt), as
        drafting would; without, -1 marks a group with no trie."""
        paths = self._attached(paths) if attach else np.asarray(paths, np.int64).reshape(-1)
        groups = self._path_group[paths]
        if (groups < 0).any():
            raise ValueError("a path was released")
        return self._groups[groups, R.ROOT].copy()

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

    def draft(self, paths, max_tokens, min_prob=None):
        """Most likely continuation of each path, at most ``max_tokens[i]``
        long, and the estimated chance that each prefix is accepted
        (``min_prob`` raises the options' one for this call).

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
        floor = o.min_prob if min_prob is None else max(o.min_prob, min_prob)
        return self.forest.draft_many(cursor[:, 0], cursor[:, 1], o.cross_group_weight,
                                      max_tokens, k, floor, o.min_match, o.prior)

    def extend_and_draft(self, paths, buffer, rows, begins, ends, max_tokens, min_prob=None):
        """:meth:`extend_from` then :meth:`draft`, in one compiled call (every
        path's tokens go in before any path drafts); ``min_prob`` raises the
        options' one for this call. The arrays returned are the forest's
        buffers: valid until the next call."""
        o, f = self.options, self.forest
        # the common call (the proposer's: int64 arrays) converts nothing; a
        # dtype check by identity, not ==, which costs a conversion of its own
        if type(paths) is not ndarray or paths.dtype is not _I64:
            paths = np.asarray(paths, np.int64)
        if type(rows) is not ndarray or rows.dtype is not _I64:
            rows = np.asarray(rows, np.int64)
        if type(begins) is not ndarray or begins.dtype is not _I64:
            begins = np.asarray(begins, np.int64)
        if type(ends) is not ndarray or ends.dtype is not _I64:
            ends = np.asarray(ends, np.int64)
        if type(max_tokens) is not ndarray or max_tokens.dtype is not _I64:
            max_tokens = np.asarray(max_tokens, np.int64)
        m = len(paths)
        if not m == len(rows) == len(begins) == len(ends) == len(max_tokens) or paths.ndim != 1:
            raise ValueError("paths, rows, begins, ends and max_tokens must have equal length")
        if type(buffer) is not ndarray:
            buffer = np.asarray(buffer)
        if buffer.ndim != 2 or buffer.dtype.kind not in "iu":
            raise ValueError("token buffer must be a 2-D integer array")
        floor = min_prob if min_prob is not None and min_prob > o.min_prob else o.min_prob  # max()
        check_room = not f.tidy_pending
        if not check_room:
            self._make_room()
        if m > len(f._lens):
            f._grow_drafts(m, len(f._toks) // len(f._lens))
        full = 0
        while True:
            t0, t1 = f._tables
            err, k = R.extend_and_draft(
                f._nodes, t0, t1, f._shift, f.half, f._state, f.meta, f.max_depth, f.young,
                f._slots, self._cursor, self._path_group, self._groups, self._reg, paths, buffer,
                rows, begins, ends, max_tokens, o.cross_group_weight, floor, o.min_match, o.prior,
                self._cross_start(), check_room, ROTATE_AT, OLD_FULL_AT, o.cross_group_tokens,
                f._starts, f._memo, f._toks, f._probs, f._lens)
            if not err:
                views = f.draft_views.get((m, k))
                if views is None:  # made once per shape: a batch drains through few
                    views = (f._toks[:m * k].reshape(m, k), f._probs[:m * k].reshape(m, k),
                             f._lens[:m])
                    if len(f.draft_views) >= 256:
                        f.draft_views.clear()
                    f.draft_views[m, k] = views
                return views
            if err == R.ROOM:  # rotate or restart the cross-group trie, then go on
                self._make_room()
                check_room = False
            elif err == R.UNATTACHED:  # an evicted group trie to rebuild first
                self._attached(paths)
            elif err == R.SMALL:
                f._grow_drafts(m, k)
            elif err == R.FULL:
                full += 1
                if full == 3:
                    raise ValueError("one call appends more than half of max_trie_nodes can hold")
                self._rotate()
            else:
                f.raise_for(err)
                raise ValueError("unknown path id")

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
        elif f.tokens_appended - self._reg[R.CROSS_SINCE] > self.options.cross_group_tokens:
            self._new_cross()  # the old trie stays, as garbage, until its half is dropped

    def _rotate(self) -> None:
        """Drop the old half of the arena whole and start new tries there,
        the cross-group trie's among them. The dropped tries were started a
        half's worth of appends ago: garbage and idle groups, as a rule; a
        group still live in it (a very long generation) loses its trie, and
        its paths re-attach at the root of a new one (see _attach).
        O(groups + paths), no pass over the nodes."""
        wall, cpu = time.perf_counter(), time.process_time()
        f = self.forest
        dropped = f.old
        self.nodes_evicted += f.num_nodes(dropped)
        f.rotate()
        lo, hi = dropped * f.half, (dropped + 1) * f.half
        tries, live = R.drop_tries(self._groups, self._reg, self._gfree, lo, hi)
        self.groups_evicted += tries
        self.live_groups_evicted += live
        self._cross_roots = [r for r in self._cross_roots if not lo <= r < hi]
        cursor = self._cursor
        cursor[(cursor >= lo) & (cursor < hi)] = UNSET
        self.evictions += 1
        # The cross-group trie takes every path's tokens: left in the old half
        # it would fill it and drop that half's live groups early.
        self._new_cross()
        wall = time.perf_counter() - wall
        self.eviction_s += wall
        self.eviction_cpu_s += time.process_time() - cpu
        self.eviction_max_s = max(self.eviction_max_s, wall)

    def drop_tries(self) -> None:
        """Start every trie afresh (a new arena), keeping paths and their
        groups: after a failure that may have left the tries inconsistent,
        siblings still in flight share a group again from the next call."""
        self.forest = SuffixForest(self.options.max_depth, self.options.max_trie_nodes)
        R.drop_tries(self._groups, self._reg, self._gfree, -1, 1 << 62)
        self._cross_roots = []
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
        groups = self._path_group[paths]
        prompt_lens = self._groups[groups, R.PLEN]
        begins = np.maximum(prompt_lens, ends - max_tokens)
        whole = begins == prompt_lens  # the whole output: it does follow the prompt
        self._cursor[paths[whole], 0] = self._groups[groups[whole], R.START]
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

    def _new_cross(self) -> None:
        """Start a new cross-group trie; paths re-attach to it when next used."""
        root = self._new_root()
        self._reg[R.CROSS_SINCE] = self.forest.tokens_appended
        self._cross_roots.append(root)
        self._cursor[self._cursor[:, 1] >= 0, 1] = UNSET

    def _cross_start(self) -> int:
        return self._cross_roots[-1] if self.options.cross_group_weight > 0 else -1

    def _build(self, group: int) -> None:
        """Give the group a trie holding its prompt tail, if it has none."""
        if self._groups[group, R.ROOT] < 0:
            tail = self._tails[group].reshape(1, -1)
            f = self.forest

            def build():  # a root left empty by a full half is garbage in it
                t0, t1 = f._tables
                root, node, event = R.build(f._nodes, t0, t1, f._shift, f.half, f._state,
                                            f.max_depth, f.young, tail, 0, 0, tail.shape[1])
                if event == R.ROOT_FULL:
                    self._rotate()
                    root, node, event = R.build(f._nodes, *f._tables, f._shift, f.half, f._state,
                                                f.max_depth, f.young, tail, 0, 0, tail.shape[1])
                if event != R.DONE:
                    raise ForestFull(f.young)
                f.meta[0] += tail.shape[1]
                return root, node
            self._groups[group, R.ROOT], self._groups[group, R.START] = self._retrying(
                build, "a prompt tail needs")

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
        group = int(self._path_group[path])
        if group < 0:
            raise ValueError(f"path {path} was released")
        if self._cursor[path, 0] == UNSET:
            self._build(group)
            self._cursor[path, 0] = self._groups[group, R.ROOT]
        if self._cursor[path, 1] == UNSET:
            self._cursor[path, 1] = self._cross_start()
