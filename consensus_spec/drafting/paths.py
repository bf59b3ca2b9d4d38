"""The drafter's registry of paths and sibling groups: arrays that compiled
calls (:mod:`.path_kernels`) register, attach and release, one call for all
the paths a step starts, none per path in Python.

A path is a row of the cursor array (its nodes in its group's trie and the
cross-group trie) and of ``_path_group``; a group is a row of ``_groups``
(its trie, live paths, prompt length and hash, LRU links; columns in
:mod:`.path_kernels`) and keeps its prompt tail, to rebuild its trie after
an eviction. :class:`~.drafter.ConsensusDrafter` is a registry over its
forest; it provides ``forest``, ``options``, ``_rotate``, ``_new_cross``
and ``_cross_start``, which registering a path may need.
"""

from __future__ import annotations

import numpy as np

from .. import keymap
from . import path_kernels as R
from .forest import TOKEN_LIMIT, UNSET

_NO_HASHES = np.zeros(0, np.uint64)

# The young half is retired (the old one dropped) once this full, so the
# retiring half keeps a quarter for its live paths' appends.
ROTATE_AT = 0.75
# The old half is dropped early, live groups and all, once this full.
OLD_FULL_AT = 0.95


class PathRegistry:
    def __init__(self):
        R.kernel.compile()
        self._reg = np.zeros(8, np.int64)  # the registry's scalars (R.FREE_PATHS ...)
        self._reg[R.OLDEST] = self._reg[R.NEWEST] = -1
        self._cursor = np.zeros((0, 2), np.int64)  # path -> (node in group trie, in cross trie)
        self._path_group = np.zeros(0, np.int64)    # path -> its group (-1: free id)
        self._pfree = np.zeros(0, np.int64)         # free path ids, a stack
        self._groups = np.zeros((0, 9), np.int64)   # group rows (columns R.ROOT ...)
        self._gfree = np.zeros(0, np.int64)         # free group rows, a stack
        self._gtable = np.full(1, -1, np.int64)     # (prompt length, hash) -> remembered group
        self._tails: list = []                      # group -> its prompt tail
        self._made = np.zeros((2, 0), np.int64)     # start_paths' new groups (group, index)
        self._grow(64)
        self._grow_groups(64)

    @property
    def num_groups(self) -> int:
        """Groups remembered (their prompts in the LRU)."""
        return int(self._reg[R.NUM_REMEMBERED])

    @property
    def group_tokens(self) -> int:
        """Tokens the remembered groups hold (at most ``max_group_tokens``,
        or one group's alone)."""
        return int(self._reg[R.GROUP_TOKENS])

    @property
    def num_paths(self) -> int:
        """Paths added and not released."""
        return len(self._path_group) - int(self._reg[R.FREE_PATHS])

    @property
    def num_live_groups(self) -> int:
        """Groups with paths added and not released (remembered or not)."""
        return int(self._reg[R.LIVE_GROUPS])

    @property
    def path_slots(self) -> int:
        """Rows of the per-path arrays: the most paths ever live at once,
        rounded up to a power of two, at least 64 (released ids are reused)."""
        return len(self._path_group)

    @property
    def group_slots(self) -> int:
        """Rows of the group arrays: the most groups held at once (remembered,
        live or with a trie in the arena), rounded up to a power of two."""
        return len(self._groups)

    def group_of(self, path: int) -> int:
        """The path's group (a row of the registry; -1: no such live path)."""
        return int(self._path_group[path]) if 0 <= path < len(self._path_group) else -1

    def group_root(self, group: int) -> int:
        """Root of the group's trie (-1: none now)."""
        return int(self._groups[group, R.ROOT])

    def prompt_tail(self, root: int) -> np.ndarray | None:
        """The prompt tail of the group whose trie is rooted at ``root``
        (None: no group's, e.g. the cross-group trie)."""
        g = np.flatnonzero((self._groups[:, R.ROOT] == root) & (self._groups[:, R.STATE] != R.FREE_ROW))
        return self._tails[int(g[0])] if len(g) and root >= 0 else None

    def add_path(self, prompt) -> int:
        """Register a new path continuing ``prompt`` (token ids); returns its id."""
        prompt = np.asarray(prompt, np.int64).reshape(1, -1)
        return int(self.start_paths(prompt, np.zeros(1, np.int64), np.array([prompt.shape[1]]))[0])

    def start_paths(self, buffer, rows, ends, hashes=None) -> np.ndarray:
        """:meth:`add_path` for each prompt ``buffer[rows[i], :ends[i]]``, in
        order, in one compiled call; returns the new path ids. ``hashes``:
        the prompts' :func:`~consensus_spec.keymap.seq_hash`, if the caller
        has them (the row tracker does)."""
        buffer = buffer if type(buffer) is np.ndarray else np.asarray(buffer)
        rows, ends = np.asarray(rows, np.int64), np.asarray(ends, np.int64)
        hashes = _NO_HASHES if hashes is None else np.asarray(hashes, np.uint64)
        if buffer.ndim != 2 or buffer.dtype.kind not in "iu" or rows.shape != ends.shape \
                or rows.ndim != 1 or len(hashes) not in (0, len(rows)):
            raise ValueError("need a 2-D integer token buffer, and rows, ends (and hashes) alike")
        out = np.empty(len(rows), np.int64)
        if self._made.shape[1] < len(rows):
            self._made = np.zeros((2, len(rows)), np.int64)
        o, f = self.options, self.forest
        i = phase = made = tries = 0
        while True:
            t0, t1 = f._tables
            i, phase, event, made = R.add_paths(
                buffer, rows, ends, hashes, out, i, phase, self._made, made, self._path_group,
                self._pfree, self._cursor, self._groups, self._gtable, self._gfree, self._reg,
                f._nodes, t0, t1, f._shift, f.half, f._state, f.meta, f.max_depth, f.young, f._slots,
                self._cross_start(), o.prompt_tokens, o.max_group_tokens, o.cross_group_tokens,
                ROTATE_AT, OLD_FULL_AT, TOKEN_LIMIT)
            if event == R.DONE:
                break
            if event == R.GROW_PATHS:
                self._grow(2 * len(self._path_group))
            elif event == R.GROW_GROUPS:
                self._grow_groups(2 * len(self._groups))
            elif event in (R.ROTATE, R.ROOT_FULL):
                self._rotate()
            elif event == R.NEW_CROSS:
                self._new_cross()
            elif event == R.BUILD_FULL:
                tries += 1
                if tries == 3:
                    raise ValueError("a prompt tail needs more than half of max_trie_nodes can hold")
                self._rotate()
            elif event == R.BAD_ROW:
                raise ValueError("rows and ends must lie inside the token buffer")
            else:
                raise ValueError(f"token ids must be in [0, {TOKEN_LIMIT})")
        for j in range(made):  # each new group keeps its prompt's tail
            g, k = int(self._made[0, j]), int(self._made[1, j])
            end = int(ends[k])
            n = int(self._groups[g, R.SIZE]) - end  # the tail's length (tail_length)
            self._tails[g] = np.array(buffer[rows[k], end - n:end], np.int32)
        return out

    def release(self, path: int) -> None:
        """Forget a finished path; its id may be reused."""
        self.release_paths(np.array([path], np.int64))

    def release_paths(self, paths) -> None:
        """:meth:`release` each of ``paths``, in order, in one compiled call."""
        paths = np.asarray(paths, np.int64).reshape(-1)
        bad = R.release_paths(paths, self._path_group, self._cursor, self._pfree, self._groups,
                              self._reg, self._gfree)
        if bad >= 0:
            raise ValueError(f"no such path: {int(paths[bad])}")

    def _grow(self, new: int) -> None:
        """Per-path arrays for ``new`` paths (new ids free, lowest first)."""
        old = len(self._path_group)
        n = int(self._reg[R.FREE_PATHS])
        self._path_group = np.concatenate([self._path_group, np.full(new - old, -1, np.int64)])
        pfree = np.zeros(new, np.int64)
        pfree[:n] = self._pfree[:n]
        pfree[n:n + new - old] = np.arange(new - 1, old - 1, -1)
        self._pfree = pfree
        self._reg[R.FREE_PATHS] = n + new - old
        cursor = np.full((new, 2), UNSET, np.int64)
        cursor[:old] = self._cursor
        self._cursor = cursor

    def _grow_groups(self, new: int) -> None:
        """Group arrays for ``new`` groups, and a table twice that (at most half full)."""
        old = len(self._groups)
        n = int(self._reg[R.FREE_GROUPS])
        groups = np.zeros((new, 9), np.int64)
        groups[:old] = self._groups
        gfree = np.zeros(new, np.int64)
        gfree[:n] = self._gfree[:n]
        gfree[n:n + new - old] = np.arange(new - 1, old - 1, -1)
        self._groups, self._gfree = groups, gfree
        self._reg[R.FREE_GROUPS] = n + new - old
        self._tails.extend([None] * (new - old))
        remembered = np.flatnonzero(groups[:, R.STATE] == R.REMEMBERED)
        self._gtable = keymap.rebuilt(2 * new, groups[:, R.PLEN], groups[:, R.HASH], remembered)

