"""Sequence keys (length, 64-bit hash of every token) and an open-addressing
map from them to rows of the caller's arrays, in compiled code: the row
tracker knows paths by such keys, and finds its parked paths, and the
drafter its sibling groups, by the map. One hash for both, so a prompt's
key the tracker computed is the drafter's too.

``table`` is a power-of-two int64 array of row ids (-1: empty slot), kept at
most half full by its owner; a row's key is ``lens[row]``, ``hashes[row]``
(the hash's bits as int64). Linear probing; removal shifts the rest of the
probe cluster back (no tombstones), so lookups never slow down with churn. Both keep their
rows in recency order too (:func:`lru_append`, :func:`lru_unlink`).
"""

from __future__ import annotations

import numpy as np

from .jit import Kernels

_FIB = np.uint64(0x9E3779B97F4A7C15)  # odd: each hash step is a bijection
_SHIFT = np.uint64(32)
EMPTY = np.uint64(0)  # hash of no tokens

kernel = Kernels(globals())


@kernel
def mix(h, token):
    """Hash of a sequence with hash ``h`` followed by ``token`` (uint64)."""
    h = (h + np.uint64(token + 1)) * _FIB
    return h ^ (h >> _SHIFT)  # fold high bits down: no polynomial structure to collide on


@kernel
def seq_hash(h, tokens, row, begin, end):
    """``h`` extended by ``tokens[row, begin:end]``."""
    for t in range(begin, end):
        h = mix(h, tokens[row, t])
    return h


@kernel
def home(table, length, h):
    """First slot of key (length, h)'s probe sequence."""
    x = (np.uint64(h) ^ np.uint64(length)) * _FIB
    x ^= x >> np.uint64(29)
    return np.int64(x & np.uint64(table.shape[0] - 1))


@kernel
def find(table, lens, hashes, length, h):
    """The row whose key is (length, h), or -1."""
    mask = table.shape[0] - 1
    i = home(table, length, h)
    while table[i] >= 0:
        r = table[i]
        if lens[r] == length and hashes[r] == h:
            return r
        i = (i + 1) & mask
    return -1


@kernel
def insert(table, lens, hashes, row):
    """Map row's key to it (the key must not be in the table)."""
    mask = table.shape[0] - 1
    i = home(table, lens[row], hashes[row])
    while table[i] >= 0:
        i = (i + 1) & mask
    table[i] = row


@kernel
def remove(table, lens, hashes, row):
    """Take ``row`` (in the table) out, shifting later entries of its cluster back."""
    mask = table.shape[0] - 1
    i = home(table, lens[row], hashes[row])
    while table[i] != row:
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        if table[j] < 0:
            break
        k = home(table, lens[table[j]], hashes[table[j]])
        # the entry at j may fill the hole at i unless its home lies in (i, j]
        if (i < j and (k <= i or k > j)) or (j < i and k <= i and k > j):
            table[i] = table[j]
            i = j
    table[i] = -1


@kernel
def lru_unlink(prev, nxt, ends, r):
    """Take row ``r`` out of a recency list over the caller's rows: ``prev``
    and ``nxt`` its rows' links (-1: none), ``ends`` the oldest and newest row."""
    p, n = prev[r], nxt[r]
    if p >= 0:
        nxt[p] = n
    else:
        ends[0] = n
    if n >= 0:
        prev[n] = p
    else:
        ends[1] = p


@kernel
def lru_append(prev, nxt, ends, r):
    """Row ``r`` becomes the newest of the recency list (see :func:`lru_unlink`)."""
    last = ends[1]
    prev[r], nxt[r] = last, -1
    if last >= 0:
        nxt[last] = r
    else:
        ends[0] = r
    ends[1] = r


def rebuilt(size: int, lens: np.ndarray, hashes: np.ndarray, rows) -> np.ndarray:
    """A table of ``size`` slots (a power of two) mapping ``rows``."""
    kernel.compile()
    table = np.full(size, -1, np.int64)
    for r in rows:
        insert(table, lens, hashes, int(r))
    return table
