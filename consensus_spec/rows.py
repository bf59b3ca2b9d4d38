"""Which path is in which batch row, found from token content alone.

vLLM's proposer interface passes no request ids: rows are condensed when
requests finish, reused, preempted and resumed, and prefills arrive in chunks.
A row keeps its path while the row's tokens continue where that path left off
(same length, same last token). Otherwise the row's occupant is parked under
its (length, last four tokens) fingerprint and the row is matched against parked paths;
a row that matches none starts a new path whose prompt is every token before
its first sampled one. Paths with identical tokens are interchangeable, so a
fingerprint collision between them costs nothing.
"""

from __future__ import annotations

from collections import OrderedDict

_TAIL = 4  # tokens in a fingerprint


class RowState:
    __slots__ = ("path", "length", "tail")

    def __init__(self, path, length: int, tail: tuple):
        self.path = path
        self.length = length
        self.tail = tail  # last _TAIL tokens


class RowTracker:
    def __init__(self, start_path, max_parked: int = 4096):
        self._start_path = start_path  # prompt tokens -> new path
        self._rows: dict[int, RowState] = {}
        self._parked: OrderedDict[tuple, list] = OrderedDict()
        self._max_parked = max_parked
        self.paths_started = 0
        self.paths_resumed = 0

    def paths_for(self, sampled_token_ids, num_tokens, token_ids) -> list:
        """The path of every row (None for rows without sampled tokens).

        Call once per step, then ``advance`` each row that gets new tokens.
        """
        num_rows = len(sampled_token_ids)
        for r in [r for r in self._rows if r >= num_rows]:
            self._park(self._rows.pop(r))
        paths: list = [None] * num_rows
        unmatched = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                continue
            base = int(num_tokens[i]) - len(sampled)
            st = self._rows.get(i)
            if st is not None and st.length == base and base > 0 and int(token_ids[i, base - 1]) == st.tail[-1]:
                paths[i] = st.path
                continue
            if st is not None:
                self._park(self._rows.pop(i))
            unmatched.append((i, base))
        for i, base in unmatched:
            row = token_ids[i]
            tail = tuple(int(t) for t in row[max(0, base - _TAIL):base])
            path = self._unpark((base, tail))
            if path is None:
                path = self._start_path(row[:base])
                self.paths_started += 1
            else:
                self.paths_resumed += 1
            paths[i] = path
            self._rows[i] = RowState(path, base, tail)
        return paths

    def advance(self, row: int, num_tokens: int, new_tokens) -> None:
        st = self._rows[row]
        st.length = num_tokens
        st.tail = (st.tail + tuple(new_tokens))[-_TAIL:]

    def _park(self, st: RowState) -> None:
        key = (st.length, st.tail)
        self._parked.setdefault(key, []).append(st.path)
        self._parked.move_to_end(key)
        while len(self._parked) > self._max_parked:
            self._parked.popitem(last=False)

    def _unpark(self, key: tuple):
        bucket = self._parked.get(key)
        if not bucket:
            return None
        path = bucket.pop()
        if not bucket:
            del self._parked[key]
        return path
