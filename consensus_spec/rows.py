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

The common case, a row continuing exactly, is checked for all rows at once
with numpy; only the others take the per-row slow path.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

_TAIL = 4          # tokens in a fingerprint
_OFFSETS = np.arange(-_TAIL, 0)
_MAX_SCAN = 32     # parked lengths tried for a row that moved during missed steps


def _tails(token_ids, rows: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """(len(rows), _TAIL) tokens before each end (index-clipped for short rows)."""
    cols = np.maximum(ends[:, None] + _OFFSETS, 0)
    return np.asarray(token_ids)[rows[:, None], cols]


class RowTracker:
    def __init__(self, start_path, max_parked: int = 4096):
        self._start_path = start_path  # prompt tokens -> new path
        self._paths: dict[int, object] = {}  # row -> path
        self._lens = np.full(0, -1, np.int64)  # row -> path length (-1: none)
        self._tail = np.zeros((0, _TAIL), np.int64)  # row -> path's last tokens
        self._parked: OrderedDict[tuple, list] = OrderedDict()
        self._parked_lengths: dict[int, int] = {}  # length -> parked keys with it
        self._max_parked = max_parked
        self.paths_started = 0
        self.paths_resumed = 0
        self.tokens_missed = 0  # tokens generated while no propose call saw them

    def update(self, sampled_token_ids, num_tokens, token_ids) -> list:
        """Per row: ``(path, new_tokens, contiguous)``, or None for rows without
        sampled tokens. ``new_tokens`` includes tokens from missed steps;
        ``contiguous`` is False when steps were missed or the path was just
        (re)attached. Call once per step."""
        num_rows = len(sampled_token_ids)
        self._grow(num_rows)
        for r in [r for r in self._paths if r >= num_rows]:
            self._park(r)
        idx = np.arange(num_rows)
        counts = np.fromiter(map(len, sampled_token_ids), np.int64, num_rows)
        ends = np.asarray(num_tokens[:num_rows], np.int64)
        base = ends - counts
        exact = ((counts > 0) & (base == self._lens[:num_rows])
                 & (_tails(token_ids, idx, base) == self._tail[:num_rows]).all(axis=1))
        out: list = [None] * num_rows
        for i in np.flatnonzero(exact).tolist():
            out[i] = (self._paths[i], sampled_token_ids[i], True)
        moved = []
        for i in np.flatnonzero((counts > 0) & ~exact).tolist():
            out[i] = self._caught_up(i, int(base[i]), int(ends[i]), token_ids[i])
            if out[i] is None:
                if i in self._paths:
                    self._park(i)  # before any row looks for it among the parked
                moved.append(i)
        for i in moved:
            out[i] = self._reattach(i, int(base[i]), int(ends[i]), token_ids[i])
        live = counts > 0
        self._lens[:num_rows][live] = ends[live]
        self._tail[:num_rows][live] = _tails(token_ids, idx[live], ends[live])
        return out

    def _caught_up(self, i: int, base: int, end: int, row):
        """The row's path, if the row continues it after steps the drafter missed."""
        length = int(self._lens[i])
        if 0 < length <= base and tuple(row[max(0, length - _TAIL):length].tolist()) == \
                self._key_tail(i):
            self.tokens_missed += base - length
            return self._paths[i], row[length:end].tolist(), False
        return None

    def _reattach(self, i: int, base: int, end: int, row):
        """A parked path the row continues, else a new path."""
        found = self._unpark(row, base)
        if found is None:
            path, length = self._start_path(row[:base]), base
            self.paths_started += 1
        else:
            path, length = found
            self.paths_resumed += 1
            self.tokens_missed += base - length
        self._paths[i] = path
        return path, row[length:end].tolist(), False

    def _key_tail(self, i: int) -> tuple:
        n = int(self._lens[i])
        return tuple(self._tail[i, _TAIL - min(n, _TAIL):].tolist())

    def _grow(self, rows: int) -> None:
        if rows > len(self._lens):
            extra = rows - len(self._lens)
            self._lens = np.concatenate([self._lens, np.full(extra, -1, np.int64)])
            self._tail = np.concatenate([self._tail, np.zeros((extra, _TAIL), np.int64)])

    def _park(self, r: int) -> None:
        key = (int(self._lens[r]), self._key_tail(r))
        bucket = self._parked.get(key)
        if bucket is None:
            self._parked[key] = bucket = []
            self._parked_lengths[key[0]] = self._parked_lengths.get(key[0], 0) + 1
        bucket.append(self._paths.pop(r))
        self._lens[r] = -1
        self._parked.move_to_end(key)
        while len(self._parked) > self._max_parked:
            self._drop(next(iter(self._parked)))

    def _unpark(self, row, base: int):
        """(path, length) of a parked path this row continues, or None."""
        def key(n):
            return (n, tuple(row[max(0, n - _TAIL):n].tolist()))

        k = key(base)
        if k not in self._parked:  # it may have advanced during missed steps
            lengths = sorted((n for n in self._parked_lengths if n < base), reverse=True)
            k = next((c for c in map(key, lengths[:_MAX_SCAN]) if c in self._parked), None)
            if k is None:
                return None
        bucket = self._parked[k]
        path = bucket.pop()
        if not bucket:
            self._drop(k)
        return path, k[0]

    def _drop(self, key: tuple) -> None:
        del self._parked[key]
        left = self._parked_lengths[key[0]] - 1
        if left:
            self._parked_lengths[key[0]] = left
        else:
            del self._parked_lengths[key[0]]
