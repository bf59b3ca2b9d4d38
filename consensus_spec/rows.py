"""Which path is in which batch row, found from token content alone.

vLLM's proposer interface passes no request ids: rows are condensed when
requests finish, reused, preempted and resumed, prefills arrive in chunks,
and whole steps go by without a propose call (vLLM skips the drafter while
any row is within ``k`` tokens of ``max_model_len``). A row keeps its path
while the row's tokens continue where that path left off: the path's last
four tokens are still in place, possibly followed by tokens the tracker missed.
Otherwise the row's occupant is parked under its (length, last tokens)
fingerprint and the row is matched against parked paths; a row that matches
none starts a new path whose prompt is every token before its first sampled
one. Paths with identical tokens are interchangeable, so a fingerprint
collision between them costs nothing.
"""

from __future__ import annotations

from collections import OrderedDict

_TAIL = 4          # tokens in a fingerprint
_MAX_SCAN = 32     # parked lengths tried for a row that moved during missed steps


class RowState:
    __slots__ = ("path", "length", "tail")

    def __init__(self, path, length: int, tail: tuple):
        self.path = path
        self.length = length
        self.tail = tail  # last _TAIL tokens


def _tail(row, end: int) -> tuple:
    return tuple(row[max(0, end - _TAIL):end].tolist())


class RowTracker:
    def __init__(self, start_path, max_parked: int = 4096):
        self._start_path = start_path  # prompt tokens -> new path
        self._rows: dict[int, RowState] = {}
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
        for r in [r for r in self._rows if r >= num_rows]:
            self._park(self._rows.pop(r))
        out: list = [None] * num_rows
        unmatched = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                continue
            n = int(num_tokens[i])
            base = n - len(sampled)
            st = self._rows.get(i)
            if st is not None and st.length <= base and st.length > 0:
                row = token_ids[i]
                if _tail(row, st.length) == st.tail:
                    if st.length == base:
                        out[i] = self._advance(st, list(sampled), n, True)
                        continue
                    missed = row[st.length:base].tolist()
                    self.tokens_missed += len(missed)
                    out[i] = self._advance(st, missed + list(sampled), n, False)
                    continue
            if st is not None:
                self._park(self._rows.pop(i))
            unmatched.append((i, base, n))
        for i, base, n in unmatched:
            row = token_ids[i]
            found = self._unpark(row, base)
            if found is None:
                path = self._start_path(row[:base])
                self.paths_started += 1
                st = RowState(path, base, _tail(row, base))
            else:
                self.paths_resumed += 1
                st = found
            self._rows[i] = st
            new = row[st.length:n].tolist()
            self.tokens_missed += max(0, base - st.length)
            out[i] = self._advance(st, new, n, False)
        return out

    @staticmethod
    def _advance(st: RowState, new: list, n: int, contiguous: bool):
        st.length = n
        st.tail = (st.tail + tuple(new))[-_TAIL:]
        return st.path, new, contiguous

    def _park(self, st: RowState) -> None:
        key = (st.length, st.tail)
        bucket = self._parked.get(key)
        if bucket is None:
            self._parked[key] = bucket = []
            self._parked_lengths[st.length] = self._parked_lengths.get(st.length, 0) + 1
        bucket.append(st)
        self._parked.move_to_end(key)
        while len(self._parked) > self._max_parked:
            self._drop(next(iter(self._parked)))

    def _unpark(self, row, base: int) -> RowState | None:
        key = (base, _tail(row, base))
        if key not in self._parked:  # it may have advanced during missed steps
            lengths = sorted((L for L in self._parked_lengths if L < base), reverse=True)
            key = next((k for k in ((L, _tail(row, L)) for L in lengths[:_MAX_SCAN])
                        if k in self._parked), None)
            if key is None:
                return None
        bucket = self._parked[key]
        st = bucket.pop()
        if not bucket:
            self._drop(key)
        return st

    def _drop(self, key: tuple) -> None:
        del self._parked[key]
        left = self._parked_lengths[key[0]] - 1
        if left:
            self._parked_lengths[key[0]] = left
        else:
            del self._parked_lengths[key[0]]
