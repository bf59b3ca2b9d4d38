"""Which path is in which batch row, found from token content alone.

vLLM's proposer interface passes no request ids: rows are condensed when
requests finish, reused, preempted and resumed, prefills arrive in chunks,
and whole steps go by without a propose call (vLLM skips the drafter while
any row is within ``k`` tokens of ``max_model_len``). A path is known by a
64-bit hash of its whole token sequence, kept per row and extended by each
step's new tokens, so paths of different prompts (or siblings that differ
anywhere) are not confused because their length and last tokens agree.

A row keeps its path while it continues exactly where that path left off:
same length, last four tokens in place (O(1) per row: the steady state).
A former path its own row does not continue is a free candidate (vLLM
condenses the batch by moving its last rows into the holes finished
requests left). Rows that don't continue exactly are rare (moved, caught
up after missed steps, resumed, new) and get their prefix hashes in one
O(length) pass: a row takes its own former path, else the longest free
candidate, whose hash equals the row's prefix hash at that path's length.
An exact row is also checked by full hash when some free candidate's last
four tokens sit in the row at that candidate's length, as they would if
the candidate had moved there. A free path no row takes is parked under
(length, hash); a row that matches nothing resumes a parked path that its
first tokens hash to (up to ``_MAX_MISSED`` tokens back), else starts a new
path whose prompt is every token before its first sampled one. Paths with
identical tokens are interchangeable, so confusing them costs nothing.

Holes left: a request from outside the batch (new or resumed) that lands
in a row whose last-seen path has left it (finished, preempted, or moved
during missed steps), with that path's exact length and last four tokens,
is taken to continue that path unless a free path's tail in the row gives
it away; catching every such case would mean hashing every row every step.
And hash collisions, about 2**-64 per comparison (the mixing step is not a
plain polynomial, so no known token pattern forces one).

Inputs are checked before any token is read (numba does no bounds checks):
shapes that don't fit raise ``ValueError``; a row whose sampled entry is
not a list, whose token count or end doesn't fit the buffer, or whose
tokens the drafter would read include an id outside ``[0, token_limit)``
sits the step out alone and its path is freed, to be resumed once the row
makes sense again (``rows_rejected`` counts these). Other rows, its
siblings included, go on as if it were not there.
One compiled call per step matches every row; only parking, resuming and
new paths run in Python.

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

from ..jit import Kernels

_TAIL = 4          # last tokens compared for an exact continuation
_MAX_MISSED = 64   # tokens a parked path may have advanced during missed steps
_MAX_PER_KEY = 16  # parked paths kept with one (length, hash): see the module docstring
_IDLE, _EXACT, _OTHER = 0, 1, 2  # row states from _match
_MUL = np.uint64(0x9E3779B97F4A7C15)  # odd: each hash step is a bijection
_SHIFT = np.uint64(32)
_ZERO = np.uint64(0)  # hash of no tokens

kernel = Kernels(globals())


@kernel
def _mix(h, token):
    """Hash of a sequence with hash ``h`` followed by ``token``."""
    h = (h + np.uint64(token + 1)) * _MUL
    return h ^ (h >> _SHIFT)  # fold high bits down: no polynomial structure to collide on


@kernel
def _extend(h, token_ids, i, begin, end):
    for t in range(begin, end):
        h = _mix(h, token_ids[i, t])
    return h


@kernel
def _prefixes(token_ids, i, end, out):
    """out[n] = hash of row i's first n tokens, for n <= end."""
    h = out[0] = _ZERO
    for t in range(end):
        h = out[t + 1] = _mix(h, token_ids[i, t])


@kernel
def _continues(token_ids, i, length, tail):
    """Row i's tokens before ``length`` are ``tail`` (index-clipped at 0)."""
    for t in range(_TAIL):
        if token_ids[i, max(length - _TAIL + t, 0)] != tail[t]:
            return False
    return True


@kernel
def _shadowed(token_ids, i, free, lens, tail, hashes, lagged):
    """Row i, which seems to continue its own path, might instead hold a free
    path (rows ``free``) that moved there: one of row i's length and tail but
    other tokens, or after missed steps (``lagged``), a shorter one whose
    tail is in place in row i at its length."""
    for r in free:
        n = lens[r]
        if (n == lens[i] and hashes[r] != hashes[i] or lagged and 0 < n < lens[i]) \
                and _continues(token_ids, i, n, tail[r]):
            return True
    return False


@kernel
def _in_range(token_ids, i, begin, end, limit):
    """Row i's tokens in [begin, end) are ids in [0, limit)."""
    for t in range(begin, end):
        if token_ids[i, t] < 0 or token_ids[i, t] >= limit:
            return False
    return True


@kernel
def _match(counts, ends, token_ids, lens, tail, hashes, path, state, window, token_limit):
    """Find each row's path; rows with new tokens come back as (row, path,
    begin, end, contiguous), path -1 where no row's former path fits (then
    ``window[row, d]`` is the hash of the row's first ``begin - d`` tokens),
    and the former paths no row continues as (path, length, hash)."""
    num_rows, width = counts.shape[0], token_ids.shape[1]
    old_path, old_lens, old_tail, old_hash = path.copy(), lens.copy(), tail.copy(), hashes.copy()
    free = np.zeros(path.shape[0], np.bool_)  # former path not continued in its own row
    live = rejected = 0
    lagged = False  # steps were missed
    for i in range(path.shape[0]):
        if i >= num_rows:
            free[i] = old_path[i] >= 0
            path[i], lens[i] = -1, -1
        elif counts[i] == 0:
            state[i] = _IDLE
        elif counts[i] < 0 or ends[i] > width or ends[i] < counts[i] or not _in_range(
                token_ids, i, ends[i] - counts[i], ends[i], token_limit):
            # garbage: this row alone sits the step out and starts clean
            state[i], counts[i] = _IDLE, 0
            free[i] = old_path[i] >= 0
            path[i], lens[i] = -1, -1
            rejected += 1
        else:
            base = ends[i] - counts[i]
            if base == old_lens[i] and _continues(token_ids, i, base, old_tail[i]):
                state[i] = _EXACT
            elif not _in_range(token_ids, i, 0, base, token_limit):  # all of it is read
                state[i], counts[i] = _IDLE, 0
                free[i] = old_path[i] >= 0
                path[i], lens[i] = -1, -1
                rejected += 1
                continue
            else:
                state[i] = _OTHER
                free[i] = old_path[i] >= 0
                if 0 < old_lens[i] < base and _continues(token_ids, i, old_lens[i], old_tail[i]):
                    lagged = True  # this row caught up, so moved paths may have advanced too
            live += 1
    candidates = pending = np.flatnonzero(free)
    while pending.shape[0]:  # exact rows a free path may have moved into; O(length) each
        demoted = np.zeros(path.shape[0], np.bool_)
        for i in range(num_rows):
            if state[i] == _EXACT \
                    and _shadowed(token_ids, i, pending, old_lens, old_tail, old_hash, lagged) \
                    and _extend(_ZERO, token_ids, i, 0, old_lens[i]) != old_hash[i]:
                state[i] = _OTHER
                free[i] = demoted[i] = old_path[i] >= 0
        pending = np.flatnonzero(demoted)  # its path is free now: check the others against it
        candidates = np.flatnonzero(free)
    scratch = np.empty(0, np.uint64)  # prefix hashes of one non-exact row
    rows = np.empty(live, np.int64)
    paths = np.empty(live, np.int64)
    begins = np.empty(live, np.int64)
    out_ends = np.empty(live, np.int64)
    contiguous = np.empty(live, np.bool_)
    m = moved = missed = 0
    for i in range(num_rows):
        if state[i] == _IDLE:
            continue
        end = ends[i]
        base = end - counts[i]
        begin, who = base, -1
        if state[i] == _EXACT:
            who = i
            hashes[i] = _extend(old_hash[i], token_ids, i, base, end)
        else:  # caught up in its own row after missed steps, else moved here
            if scratch.shape[0] == 0:
                scratch = np.empty(width + 1, np.uint64)
            _prefixes(token_ids, i, end, scratch)
            hashes[i] = scratch[end]
            n = old_lens[i]
            if free[i] and 0 < n <= base and scratch[n] == old_hash[i]:
                who = i
            else:
                for r in candidates:
                    n = old_lens[r]
                    if free[r] and 0 < n <= base and (who < 0 or n > old_lens[who]) \
                            and scratch[n] == old_hash[r]:
                        who = r
            if who >= 0:
                free[who] = False
                begin = old_lens[who]
                moved += who != i
                missed += base - begin
            else:  # for resuming a parked path
                for d in range(min(_MAX_MISSED, base) + 1):
                    window[i, d] = scratch[base - d]
        path[i] = old_path[who] if who >= 0 else -1
        lens[i] = end
        for t in range(_TAIL):
            tail[i, t] = token_ids[i, max(end - _TAIL + t, 0)]
        rows[m], paths[m], begins[m], out_ends[m] = i, path[i], begin, end
        contiguous[m] = state[i] == _EXACT
        m += 1
    gone = candidates[free[candidates]]
    unresolved = 0
    for j in range(live):
        unresolved += paths[j] < 0
    return (rows, paths, begins, out_ends, contiguous, old_path[gone], old_lens[gone],
            old_hash[gone], moved, missed, unresolved, rejected)


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
        kernel.compile()
        self._start_path = start_path      # prompt tokens -> new path id
        self._release_path = release_path  # path id -> None, once it is forgotten
        self._path = np.full(0, -1, np.int64)   # row -> path (-1: none)
        self._lens = np.full(0, -1, np.int64)   # row -> path length (-1: none)
        self._tail = np.zeros((0, _TAIL), np.int64)  # row -> path's last tokens
        self._hash = np.zeros(0, np.uint64)     # row -> hash of the path's whole sequence
        self._window = np.zeros((0, _MAX_MISSED + 1), np.uint64)  # see _match
        self._state = np.zeros(0, np.int64)  # row -> _IDLE, _EXACT or _OTHER this step
        self._counts = np.zeros(0, np.int64)  # row -> tokens sampled this step
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
    def num_parked_keys(self) -> int:
        """Distinct (length, hash) among the parked paths."""
        return len(self._parked)

    @property
    def step_tokens(self) -> int:
        """Tokens the rows of the last update produced (sampled and accepted)."""
        return int(self._counts.sum())

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
        *step, gone, gone_lens, gone_hashes, moved, missed, unresolved, rejected = _match(
            counts, ends, token_ids, self._lens, self._tail, self._hash, self._path,
            self._state, self._window, self._token_limit)
        step = RowUpdate(*step)
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
            found = self._unpark(i, base)
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
            self._hash = np.concatenate([self._hash, np.zeros(extra, np.uint64)])
            self._window = np.zeros((rows, _MAX_MISSED + 1), np.uint64)
            self._state = np.zeros(rows, np.int64)

    def _park(self, path: int, key: tuple) -> None:
        bucket = self._parked.get(key)
        if bucket is None:
            self._parked[key] = bucket = []
            length = key[0]
            if length not in self._parked_lengths:
                insort(self._lengths_sorted, length)
            self._parked_lengths[length] = self._parked_lengths.get(length, 0) + 1
        bucket.append(path)
        self._num_parked += 1
        self._parked.move_to_end(key)
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
        window = self._window[row]  # window[d]: hash of the row's first base - d tokens
        k = (base, int(window[0]))
        if k not in self._parked:  # it may have advanced during missed steps
            lengths = self._lengths_sorted
            lo = bisect_left(lengths, max(base - _MAX_MISSED, 1))
            below = reversed(lengths[lo:bisect_left(lengths, base, lo)])
            k = next((c for c in ((n, int(window[base - n])) for n in below) if c in self._parked),
                     None)
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
