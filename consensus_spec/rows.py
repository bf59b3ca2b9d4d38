"""Which path is in which batch row, found from token content alone.

vLLM's proposer interface passes no request ids: rows are condensed when
requests finish, reused, preempted and resumed, prefills arrive in chunks,
and whole steps go by without a propose call (vLLM skips the drafter while
any row is within ``k`` tokens of ``max_model_len``). A row keeps its path
while the row's tokens continue where that path left off: the path's last
four tokens are still in place, possibly followed by tokens the tracker
missed. Otherwise the row's occupant is parked under its (length, last four
tokens) fingerprint and the row is matched against parked paths; a row that
matches none starts a new path whose prompt is every token before its first
sampled one. Paths with identical tokens are interchangeable, so a
fingerprint collision between them costs nothing.

One compiled call per step matches every row: rows continuing exactly,
rows that caught up after missed steps, and rows that took over a path
another row held (vLLM condenses the batch by moving its last rows into the
holes finished requests left). Only parking, resuming and new paths run in
Python.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict
from typing import Callable, NamedTuple

import numpy as np

from .jit import Kernels

_TAIL = 4          # tokens in a fingerprint
_MAX_MISSED = 64   # tokens a parked path may have advanced during missed steps
_IDLE, _EXACT, _OTHER = 0, 1, 2  # row states from _match

kernel = Kernels(globals())


@kernel
def _continues(token_ids, i, length, tail):
    """Row i's tokens before ``length`` are ``tail`` (index-clipped at 0)."""
    for t in range(_TAIL):
        if token_ids[i, max(length - _TAIL + t, 0)] != tail[t]:
            return False
    return True


@kernel
def _match(counts, ends, token_ids, lens, tail, path, state):
    """Find each row's path; rows with new tokens come back as (row, path,
    begin, end, contiguous), path -1 where no row's former path fits, and
    the former paths no row continues as (path, length, tail)."""
    num_rows = counts.shape[0]
    old_path, old_lens, old_tail = path.copy(), lens.copy(), tail.copy()
    free = np.zeros(path.shape[0], np.bool_)  # former path not continued in its own row
    live = 0
    for i in range(path.shape[0]):
        if i >= num_rows:
            free[i] = old_path[i] >= 0
            path[i], lens[i] = -1, -1
        elif counts[i] <= 0:
            state[i] = _IDLE
        else:
            live += 1
            base = ends[i] - counts[i]
            if base == old_lens[i] and _continues(token_ids, i, base, old_tail[i]):
                state[i] = _EXACT
            else:
                state[i] = _OTHER
                free[i] = old_path[i] >= 0
    candidates = np.flatnonzero(free)
    rows = np.empty(live, np.int64)
    paths = np.empty(live, np.int64)
    begins = np.empty(live, np.int64)
    out_ends = np.empty(live, np.int64)
    contiguous = np.empty(live, np.bool_)
    m = moved = missed = 0
    for i in range(num_rows):
        if state[i] == _IDLE:
            continue
        base = ends[i] - counts[i]
        begin, who = base, -1
        if state[i] == _EXACT:
            who = i
        else:  # caught up in its own row after missed steps, else moved here
            if free[i] and 0 < old_lens[i] <= base and _continues(token_ids, i, old_lens[i], old_tail[i]):
                who = i
            else:
                for r in candidates:
                    if free[r] and 0 < old_lens[r] <= base and (who < 0 or old_lens[r] > old_lens[who]) \
                            and _continues(token_ids, i, old_lens[r], old_tail[r]):
                        who = r
            if who >= 0:
                free[who] = False
                begin = old_lens[who]
                moved += who != i
                missed += base - begin
        path[i] = old_path[who] if who >= 0 else -1
        lens[i] = ends[i]
        for t in range(_TAIL):
            tail[i, t] = token_ids[i, max(ends[i] - _TAIL + t, 0)]
        rows[m], paths[m], begins[m], out_ends[m] = i, path[i], begin, ends[i]
        contiguous[m] = state[i] == _EXACT
        m += 1
    gone = candidates[free[candidates]]
    unresolved = 0
    for j in range(live):
        unresolved += paths[j] < 0
    return (rows, paths, begins, out_ends, contiguous,
            old_path[gone], old_lens[gone], old_tail[gone], moved, missed, unresolved)


@kernel
def _accepted(rows, paths, sent, path, state, counts):
    """Tokens the verifier kept of each draft sent last step; 0 (and nothing
    sent) where the row no longer holds that path contiguously."""
    accepted = np.zeros(rows.shape[0], np.int64)
    for j in range(rows.shape[0]):
        i = rows[j]
        if sent[j] > 0 and i < counts.shape[0] and state[i] == _EXACT and path[i] == paths[j]:
            accepted[j] = min(counts[i] - 1, sent[j])
        else:
            sent[j] = 0
    return accepted


class RowUpdate(NamedTuple):
    """The rows that produced tokens this step (arrays of equal length)."""
    rows: np.ndarray        # batch row
    paths: np.ndarray       # its path id
    begins: np.ndarray      # the path's new tokens are token_ids[row, begin:end]
    ends: np.ndarray
    contiguous: np.ndarray  # False: steps were missed or the path was just (re)attached


class RowTracker:
    def __init__(self, start_path: Callable, release_path: Callable | None = None,
                 max_parked: int = 4096):
        kernel.compile()
        self._start_path = start_path      # prompt tokens -> new path id
        self._release_path = release_path  # path id -> None, once it is forgotten
        self._path = np.full(0, -1, np.int64)   # row -> path (-1: none)
        self._lens = np.full(0, -1, np.int64)   # row -> path length (-1: none)
        self._tail = np.zeros((0, _TAIL), np.int64)  # row -> path's last tokens
        self._state = np.zeros(0, np.int64)  # row -> _IDLE, _EXACT or _OTHER this step
        self._counts = np.zeros(0, np.int64)  # row -> tokens sampled this step
        self._parked: OrderedDict[tuple, list] = OrderedDict()
        self._parked_lengths: dict[int, int] = {}  # length -> parked keys with it
        self._lengths_sorted: list[int] = []  # those lengths, ascending
        self._max_parked = max_parked
        self.paths_started = 0
        self.paths_resumed = 0  # taken back from the parked
        self.paths_moved = 0    # found in another row than last step
        self.tokens_missed = 0  # tokens generated while no propose call saw them

    def update(self, sampled_token_ids, num_tokens, token_ids) -> RowUpdate:
        """Where each row's new tokens are, and whose they are. Call once per step."""
        num_rows = len(sampled_token_ids)
        self._grow(num_rows)
        self._counts = np.fromiter(map(len, sampled_token_ids), np.int64, num_rows)
        ends = np.asarray(num_tokens[:num_rows])  # int32 in vLLM; no copy
        *step, gone, gone_lens, gone_tails, moved, missed, unresolved = _match(
            self._counts, ends, token_ids, self._lens, self._tail, self._path, self._state)
        step = RowUpdate(*step)
        self.paths_moved += moved
        self.tokens_missed += missed
        if len(gone):
            for path, length, tail in zip(gone.tolist(), gone_lens.tolist(), gone_tails.tolist()):
                self._park(path, length, tail)
        if unresolved:
            self._settle(step, token_ids)
        return step

    def accepted(self, rows, paths, sent) -> np.ndarray:
        """For drafts sent last step (``sent[j]`` tokens to ``paths[j]`` in
        row ``rows[j]``), how many the verifier kept, judged from this step's
        update. Rows that no longer hold their path contiguously count
        nothing and get ``sent[j] = 0`` (in place)."""
        return _accepted(rows, paths, sent, self._path, self._state, self._counts)

    def _settle(self, step: RowUpdate, token_ids) -> None:
        """Rows no former path fits: a parked path resumes, or a new one starts."""
        for j in np.flatnonzero(step.paths < 0).tolist():
            i, base = int(step.rows[j]), int(step.begins[j])
            found = self._unpark(token_ids[i], base)
            if found is None:
                path = self._start_path(token_ids[i][:base])
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
            self._state = np.zeros(len(self._lens), np.int64)

    def _park(self, path: int, length: int, tail: list) -> None:
        key = (length, tuple(tail[_TAIL - min(length, _TAIL):]))
        bucket = self._parked.get(key)
        if bucket is None:
            self._parked[key] = bucket = []
            if length not in self._parked_lengths:
                insort(self._lengths_sorted, length)
            self._parked_lengths[length] = self._parked_lengths.get(length, 0) + 1
        bucket.append(path)
        self._parked.move_to_end(key)
        while len(self._parked) > self._max_parked:
            for old in self._drop(next(iter(self._parked))):
                if self._release_path is not None:
                    self._release_path(old)

    def _unpark(self, row, base: int):
        """(path, length) of a parked path this row continues, or None."""
        def key(n):
            return (n, tuple(row[max(0, n - _TAIL):n].tolist()))

        k = key(base)
        if k not in self._parked:  # it may have advanced during missed steps
            lengths = self._lengths_sorted
            lo = bisect_left(lengths, base - _MAX_MISSED)
            window = lengths[lo:bisect_left(lengths, base, lo)]
            k = next((c for c in map(key, reversed(window)) if c in self._parked), None)
            if k is None:
                return None
        bucket = self._parked[k]
        path = bucket.pop()
        if not bucket:
            self._drop(k)
        return path, k[0]

    def _drop(self, key: tuple) -> list:
        left = self._parked_lengths[key[0]] - 1
        if left:
            self._parked_lengths[key[0]] = left
        else:
            del self._parked_lengths[key[0]]
            del self._lengths_sorted[bisect_left(self._lengths_sorted, key[0])]
        return self._parked.pop(key)
