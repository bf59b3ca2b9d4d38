"""The row tracker's parked paths as arrays, parked and resumed by compiled
calls (what they hold and why: the docstring of :mod:`.rows`).

A parked path is kept under its sequence's key (length, hash); a key holds
at most ``max_per_key`` paths, oldest first, and keys are kept in the order
they were last parked under, so the least recently parked key loses its
oldest path first once ``max_parked`` paths are parked. Arrays:

- ``keys`` (K, 5) int64: length, hash (the uint64's bits), previous and
  next key in park order (-1: none), paths held;
- ``paths`` (K, max_per_key + 1) int64: each key's paths, oldest first;
- ``table`` (2^n,) int64: a :mod:`~consensus_spec.keymap` from a key's
  (length, hash) to its row in ``keys``, at most half full;
- ``meta`` (8,) int64: oldest key, newest key, keys, parked paths, free
  rows, then free rows as a stack in ``free``.

K grows (by doubling, in Python) before a step could need more rows than
are free; one key's paths never exceed ``max_per_key + 1`` (the cap is
applied as the path goes in).
"""

from __future__ import annotations

import numpy as np

from .. import keymap
from ..jit import Kernels
from ..keymap import find, insert, lru_append, lru_unlink, remove  # noqa: F401  (bound compiled)

LEN, HASH, PREV, NEXT, COUNT = range(5)
OLDEST, NEWEST, KEYS, PARKED, FREE = range(5)

kernel = Kernels(globals(), uses=(keymap.kernel,))


@kernel
def _unlink(keys, meta, r):
    lru_unlink(keys[:, PREV], keys[:, NEXT], meta[OLDEST:NEWEST + 1], r)


@kernel
def _append(keys, meta, r):
    """Row r becomes the most recently parked key."""
    lru_append(keys[:, PREV], keys[:, NEXT], meta[OLDEST:NEWEST + 1], r)


@kernel
def _drop(keys, table, meta, free, r):
    """Forget key row r (its paths are the caller's)."""
    remove(table, keys[:, LEN], keys[:, HASH], r)
    _unlink(keys, meta, r)
    keys[r, COUNT] = 0
    free[meta[FREE]] = r
    meta[FREE] += 1
    meta[KEYS] -= 1


@kernel
def _pop_oldest(paths, keys, r):
    """Key row r's oldest path, taken out."""
    out = paths[r, 0]
    for t in range(1, keys[r, COUNT]):
        paths[r, t - 1] = paths[r, t]
    keys[r, COUNT] -= 1
    return out


@kernel
def park(keys, paths, table, meta, free, max_parked, max_per_key, path, length, h, released,
         n_released):
    """Park ``path`` under (length, h); paths the caps push out go to
    ``released[n_released:]``. Returns the new count of released."""
    r = find(table, keys[:, LEN], keys[:, HASH], length, h)
    if r < 0:  # a new key goes in last: the most recently parked
        meta[FREE] -= 1
        r = free[meta[FREE]]
        keys[r, LEN], keys[r, HASH], keys[r, COUNT] = length, h, 0
        insert(table, keys[:, LEN], keys[:, HASH], r)
        meta[KEYS] += 1
        _append(keys, meta, r)
    else:
        _unlink(keys, meta, r)
        _append(keys, meta, r)
    paths[r, keys[r, COUNT]] = path
    keys[r, COUNT] += 1
    meta[PARKED] += 1
    if keys[r, COUNT] > max_per_key:  # identical copies: the newest suffice
        released[n_released] = _pop_oldest(paths, keys, r)
        n_released += 1
        meta[PARKED] -= 1
    while meta[PARKED] > max_parked:  # least recently parked key, oldest path
        r = meta[OLDEST]
        released[n_released] = _pop_oldest(paths, keys, r)
        n_released += 1
        meta[PARKED] -= 1
        if keys[r, COUNT] == 0:
            _drop(keys, table, meta, free, r)
    return n_released


@kernel
def unpark(keys, paths, table, meta, free, window, row, base, max_missed):
    """(path, its length) of a parked path whose sequence is the row's first
    ``base`` tokens or up to ``max_missed`` fewer, longest first, or
    (-1, 0); taken out of the parked. ``window[row, d]``: the hash of the
    row's first ``base - d`` tokens."""
    r = find(table, keys[:, LEN], keys[:, HASH], base, np.int64(window[row, 0]))
    d = 1
    while r < 0 and d <= min(max_missed, base - 1):
        r = find(table, keys[:, LEN], keys[:, HASH], base - d, np.int64(window[row, d]))
        d += 1
    if r < 0:
        return -1, 0
    keys[r, COUNT] -= 1  # the newest copy
    path = paths[r, keys[r, COUNT]]
    length = keys[r, LEN]
    meta[PARKED] -= 1
    if keys[r, COUNT] == 0:
        _drop(keys, table, meta, free, r)
    return path, length


class Parked:
    """The arrays above, grown as needed; :func:`park` and :func:`unpark`
    work on them (the row kernels call those)."""

    def __init__(self, max_parked: int, max_per_key: int):
        kernel.compile()
        self.max_parked, self.max_per_key = max_parked, max_per_key
        self.meta = np.array([-1, -1, 0, 0, 0, 0, 0, 0], np.int64)
        self.keys = np.zeros((0, 5), np.int64)
        self.paths = np.zeros((0, max_per_key + 1), np.int64)
        self.free = np.zeros(0, np.int64)
        self.table = np.full(1, -1, np.int64)  # replaced by reserve()
        self.reserve(16)

    def reserve(self, new_keys: int) -> None:
        """Room for ``new_keys`` more keys (a step parks at most as many paths as rows)."""
        if self.meta[FREE] >= new_keys:
            return
        old = len(self.keys)
        size = max(16, 2 * old)
        while size - old + self.meta[FREE] < new_keys:
            size *= 2
        keys = np.zeros((size, 5), np.int64)
        keys[:old] = self.keys
        paths = np.zeros((size, self.max_per_key + 1), np.int64)
        paths[:old] = self.paths
        free = np.zeros(size, np.int64)
        n = int(self.meta[FREE])
        free[:n] = self.free[:n]
        free[n:n + size - old] = np.arange(size - 1, old - 1, -1)
        self.meta[FREE] = n + size - old
        table = keymap.rebuilt(2 * size, keys[:, LEN], keys[:, HASH],  # at most half full
                               np.flatnonzero(keys[:, COUNT] > 0))
        self.keys, self.paths, self.free, self.table = keys, paths, free, table

    @property
    def num_parked(self) -> int:
        return int(self.meta[PARKED])

    @property
    def num_keys(self) -> int:
        return int(self.meta[KEYS])

    def items(self) -> list:
        """((length, hash), paths oldest first) per key, least recently parked first."""
        out, r = [], int(self.meta[OLDEST])
        while r >= 0:
            h = int(np.int64(self.keys[r, HASH]).astype(np.uint64))
            out.append(((int(self.keys[r, LEN]), h),
                        self.paths[r, :self.keys[r, COUNT]].tolist()))
            r = int(self.keys[r, NEXT])
        return out
