"""Which path is in which batch row: :class:`RowTracker` parks and resumes
paths in Python around one compiled call per step that matches every row
from token content alone (how, and what it cannot tell apart: the
docstring of :mod:`.row_kernels`).

A free path no row takes is parked under (length, hash); a row that
matches nothing resumes a parked path that its first tokens hash to (up to
``_MAX_MISSED`` tokens back), else starts a new path whose prompt is every
token before its first sampled one. Paths with identical tokens are
interchangeable, so confusing them costs nothing.

What it holds, and the bound on each (so an engine that serves the same
request forever holds the same memory after warm-up):

- per-row arrays (path, length, last four tokens, hash, state, count: 72
  bytes a row, plus ``_MAX_MISSED + 1`` hashes, 520 bytes, for resuming):
  as many rows as the largest batch seen (at most vLLM's ``max_num_seqs``),
  never shrunk;
- parked paths: at most ``max_parked`` in all and ``max_per_key`` under one
  (length, hash); the index of their lengths has an entry per parked key.
  A path the tracker lets go of (dropped from the parked, never resumed) is
  handed to ``release_path`` once, so the paths it keeps the drafter holding
  are at most the batch's rows plus ``max_parked``.

Why two caps. Finished and preempted paths look alike (a row stops showing
the path), so both park, and finished ones are the many. Paths with equal
(length, hash) have the same tokens and are interchangeable, so a key needs
only as many paths as rows that could resume with that sequence, each
resumed row taking one (``_unpark``): identical rows preempted together,
such as greedy siblings of one request. ``max_per_key`` (16) keeps room for
that many; beyond it the oldest copy is released, so identical finished
paths (a request repeated with greedy outputs, short identical answers)
cannot fill the parked and push out paths that may still resume. Should
more identical rows than that resume, the extra ones start new paths
(prompt: all their tokens so far): still tracked right, only drafting from
their own history and the cross-group trie instead of their siblings'
group. ``max_parked`` bounds the total, least recently parked keys dropped
first, one path at a time. Both caps only ever forget, which costs a
resume, never a wrong match.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict
from typing import Callable, NamedTuple

import numpy as np

from . import row_kernels as K
from .row_kernels import _MAX_MISSED, _TAIL  # constants: compile() swaps only the kernels

_MAX_PER_KEY = 16  # parked paths kept with one (length, hash): see the module docstring


def _length(sampled) -> int:
    """Tokens sampled for a row; -1 (a rejected row) if it is not a list."""
    try:
        return len(sampled)
    except TypeError:
        return -1


def _integers(a: np.ndarray) -> bool:
    """Integers numba mixes with int64 as integers (uint64 would become float)."""
    return a.dtype.kind == "i" or (a.dtype.kind == "u" and a.dtype.itemsize < 8)


class RowUpdate(NamedTuple):
    """The rows that produced tokens this step (arrays of equal length)."""
    rows: np.ndarray        # batch row
    paths: np.ndarray       # its path id
    begins: np.ndarray      # the path's new tokens are token_ids[row, begin:end]
    ends: np.ndarray
    contiguous: np.ndarray  # False: steps were missed or the path was just (re)attached


class RowTracker:
    """Which path each batch row holds (see the module docstring).

    ``start_path(prompt)`` makes a new path id; ``release_path(path)`` is
    called once for each path the tracker forgets. ``max_parked``: paths
    kept, in all, for rows that may resume them; ``max_per_key``: of those,
    paths with one same (length, hash), i.e. identical token sequences."""

    def __init__(self, start_path: Callable, release_path: Callable | None = None,
                 max_parked: int = 4096, max_per_key: int = _MAX_PER_KEY,
                 token_limit: int = 1 << 62):
        if max_parked < 0 or max_per_key < 1 or token_limit < 1:
            raise ValueError("need max_parked >= 0, max_per_key >= 1 and token_limit >= 1")
        self._token_limit = token_limit  # ids at or above it (or < 0) make a row garbage
        K.kernel.compile()
        self._start_path = start_path      # prompt tokens -> new path id
        self._release_path = release_path  # path id -> None, once it is forgotten
        self._path = np.full(0, -1, np.int64)   # row -> path (-1: none)
        self._lens = np.full(0, -1, np.int64)   # row -> path length (-1: none)
        self._tail = np.zeros((0, _TAIL), np.int64)  # row -> path's last tokens
        self._hash = np.zeros(0, np.uint64)     # row -> hash of the path's whole sequence
        self._window = np.zeros((0, _MAX_MISSED + 1), np.uint64)  # see K._match
        self._state = np.zeros(0, np.int64)  # row -> K._IDLE, K._EXACT or K._OTHER this step
        self._counts = np.zeros(0, np.int64)  # row -> tokens sampled this step
        self._step_tokens = 0  # their sum
        # (length, hash) -> paths, oldest first; keys least recently parked first
        self._parked: OrderedDict[tuple, list] = OrderedDict()
        self._parked_lengths: dict[int, int] = {}  # length -> parked keys with it
        self._lengths_sorted: list[int] = []  # those lengths, ascending
        self._num_parked = 0  # paths in _parked
        self._max_parked = max_parked
        self._max_per_key = max_per_key
        self.paths_released = 0  # forgotten (handed to release_path), never to resume
        self.paths_started = 0
        self.paths_resumed = 0  # taken back from the parked
        self.paths_moved = 0    # found in another row than last step
        self.tokens_missed = 0  # tokens generated while no propose call saw them
        self.rows_rejected = 0  # row-steps skipped for inconsistent inputs

    @property
    def num_parked(self) -> int:
        """Paths parked for rows that may resume them (at most ``max_parked``)."""
        return self._num_parked

    @property
    def max_parked(self) -> int:
        return self._max_parked

    @property
    def num_parked_keys(self) -> int:
        """Distinct (length, hash) among the parked paths."""
        return len(self._parked)

    @property
    def step_tokens(self) -> int:
        """Tokens the rows of the last update produced (sampled and accepted)."""
        return self._step_tokens

    @property
    def events(self) -> int:
        """Paths started and resumed, tokens missed and rows rejected, in all:
        unchanged by a step in which every row simply continued."""
        return self.paths_started + self.paths_resumed + self.tokens_missed + self.rows_rejected

    @property
    def num_rows(self) -> int:
        """Rows the per-row arrays hold: the largest batch seen."""
        return len(self._lens)

    def update(self, sampled_token_ids, num_tokens, token_ids) -> RowUpdate:
        """Where each row's new tokens are, and whose they are. Call once per step.
        Raises ValueError (and changes nothing) if the arguments' shapes don't fit."""
        num_rows = len(sampled_token_ids)
        ends, token_ids = np.asarray(num_tokens), np.asarray(token_ids)  # no copies
        if ends.ndim != 1 or len(ends) < num_rows or not (num_rows == 0 or _integers(ends)):
            raise ValueError(f"num_tokens: need {num_rows} integers, got {ends.dtype} {ends.shape}")
        if token_ids.ndim != 2 or len(token_ids) < num_rows or not _integers(token_ids):
            raise ValueError(f"token_ids: need {num_rows} rows of integers, "
                             f"got {token_ids.dtype} {token_ids.shape}")
        try:
            counts = np.fromiter(map(len, sampled_token_ids), np.int64, num_rows)
        except TypeError:  # an entry that is not a list: that row alone sits out
            counts = np.fromiter((_length(s) for s in sampled_token_ids), np.int64, num_rows)
        ends = ends[:num_rows]
        if ends.dtype.kind != "i":  # [] is float
            ends = ends.astype(np.int64)
        self._grow(num_rows)
        self._counts = counts
        (rows, paths, begins, step_ends, contiguous, gone, gone_lens, gone_hashes, moved, missed,
         unresolved, rejected, self._step_tokens) = K._match(
            counts, ends, token_ids, self._lens, self._tail, self._hash, self._path,
            self._state, self._window, self._token_limit)
        step = RowUpdate(rows, paths, begins, step_ends, contiguous)
        self.paths_moved += moved
        self.tokens_missed += missed
        self.rows_rejected += rejected
        if len(gone):
            for path, length, h in zip(gone.tolist(), gone_lens.tolist(), gone_hashes.tolist()):
                self._park(path, (length, h))
        if unresolved:
            self._settle(step, token_ids)
        return step

    def holding(self):
        """(rows, paths, lengths) of the rows holding a path after the last
        update: where each path's whole sequence is in the token buffer."""
        rows = np.flatnonzero((self._path >= 0) & (self._lens > 0))
        return rows, self._path[rows].copy(), self._lens[rows].copy()

    def accepted(self, rows, paths, sent) -> tuple[np.ndarray, int, int]:
        """For drafts sent last step (``sent[j]`` tokens to ``paths[j]`` in
        row ``rows[j]``), how many the verifier kept, judged from this step's
        update, and their sum, and the draft tokens judged. Rows that no
        longer hold their path contiguously count nothing and get
        ``sent[j] = 0`` (in place)."""
        return K._accepted(rows, paths, sent, self._path, self._state, self._counts)

    def _settle(self, step: RowUpdate, token_ids) -> None:
        """Rows no former path fits: a parked path resumes, or a new one starts."""
        for j in np.flatnonzero(step.paths < 0).tolist():
            i, base = step.rows.item(j), step.begins.item(j)
            found = self._unpark(i, base)
            if found is None:
                path = self._start_path(token_ids[i, :base])
                self.paths_started += 1
            else:
                path, length = found
                self.paths_resumed += 1
                self.tokens_missed += base - length
                step.begins[j] = length
            self._path[i] = step.paths[j] = path

    def _grow(self, rows: int) -> None:
        if rows > len(self._lens):
            extra = rows - len(self._lens)
            self._path = np.concatenate([self._path, np.full(extra, -1, np.int64)])
            self._lens = np.concatenate([self._lens, np.full(extra, -1, np.int64)])
            self._tail = np.concatenate([self._tail, np.zeros((extra, _TAIL), np.int64)])
            self._hash = np.concatenate([self._hash, np.zeros(extra, np.uint64)])
            self._window = np.zeros((rows, _MAX_MISSED + 1), np.uint64)
            self._state = np.zeros(rows, np.int64)

    def _park(self, path: int, key: tuple) -> None:
        bucket = self._parked.get(key)
        if bucket is None:  # a new key goes in last: the most recently parked
            self._parked[key] = bucket = []
            length = key[0]
            if length not in self._parked_lengths:
                insort(self._lengths_sorted, length)
            self._parked_lengths[length] = self._parked_lengths.get(length, 0) + 1
        else:
            self._parked.move_to_end(key)
        bucket.append(path)
        self._num_parked += 1
        if len(bucket) > self._max_per_key:  # identical copies: the newest suffice
            self._release(bucket.pop(0))
        while self._num_parked > self._max_parked:  # least recently parked key, oldest path
            key = next(iter(self._parked))
            bucket = self._parked[key]
            if len(bucket) == 1:
                self._drop(key)
            self._release(bucket.pop(0))

    def _release(self, path: int) -> None:
        """Forget a path taken out of the parked."""
        self._num_parked -= 1
        self.paths_released += 1
        if self._release_path is not None:
            self._release_path(path)

    def _unpark(self, row: int, base: int):
        """(path, length) of a parked path whose sequence is row's first
        ``base`` tokens or up to ``_MAX_MISSED`` fewer, longest first, or None."""
        window = self._window  # window[row, d]: hash of the row's first base - d tokens
        k = (base, window.item(row, 0))
        if k not in self._parked:  # it may have advanced during missed steps
            lengths = self._lengths_sorted
            lo = bisect_left(lengths, max(base - _MAX_MISSED, 1))
            below = reversed(lengths[lo:bisect_left(lengths, base, lo)])
            k = next((c for c in ((n, window.item(row, base - n)) for n in below)
                      if c in self._parked), None)
            if k is None:
                return None
        bucket = self._parked[k]
        path = bucket.pop()
        self._num_parked -= 1
        if not bucket:
            self._drop(k)
        return path, k[0]

    def _drop(self, key: tuple) -> list:
        """Remove a key from the parked; returns its paths (the caller
        accounts for them)."""
        left = self._parked_lengths[key[0]] - 1
        if left:
            self._parked_lengths[key[0]] = left
        else:
            del self._parked_lengths[key[0]]
            del self._lengths_sorted[bisect_left(self._lengths_sorted, key[0])]
        return self._parked.pop(key)
