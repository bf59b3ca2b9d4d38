"""Which path is in which batch row: :class:`RowTracker` keeps it in arrays
that one compiled call per step updates, matching every row from token
content alone (how, and what it cannot tell apart: the docstring of
:mod:`.row_kernels`) and parking and resuming paths (:mod:`.parking`).

A free path no row takes is parked under (length, hash); a row that
matches nothing resumes a parked path that its first tokens hash to (up to
``MAX_MISSED`` tokens back), else starts a new path whose prompt is every
token before its first sampled one. Paths with identical tokens are
interchangeable, so confusing them costs nothing.

What it holds, and the bound on each (so an engine that serves the same
request forever holds the same memory after warm-up):

- per-row arrays (path, length, last four tokens, hash, state, count: 72
  bytes a row, plus ``MAX_MISSED + 1`` hashes, 520 bytes, for resuming):
  as many rows as the largest batch seen (at most vLLM's ``max_num_seqs``),
  never shrunk;
- parked paths: at most ``max_parked`` in all and ``max_per_key`` under one
  (length, hash), in arrays of a row per key (48 B and 8 B a path it may
  hold) and a table of two slots per key, grown by doubling to the most
  keys parked at once.
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

from typing import Callable, NamedTuple

import numpy as np

from . import row_kernels as K
from .parking import Parked
from .row_kernels import MAX_MISSED, TAIL  # constants: compile() swaps only the kernels

ndarray = np.ndarray
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
    """The rows that produced tokens this step (arrays of equal length; the
    tracker's buffers, valid until the update after next)."""
    rows: np.ndarray        # batch row
    paths: np.ndarray       # its path id
    begins: np.ndarray      # the path's new tokens are token_ids[row, begin:end]
    ends: np.ndarray
    contiguous: np.ndarray  # False: steps were missed or the path was just (re)attached


class _OnePathAtATime:
    """Per-path callables as the tracker's path registry."""

    def __init__(self, start_path: Callable, release_path: Callable | None):
        self._start, self._release = start_path, release_path

    def start_paths(self, token_ids, rows, ends, hashes=None) -> np.ndarray:
        return np.array([self._start(token_ids[r, :e]) for r, e in zip(rows.tolist(), ends.tolist())],
                        np.int64)

    def release_paths(self, paths) -> None:
        if self._release is not None:
            for p in paths.tolist():
                self._release(p)


class RowTracker:
    """Which path each batch row holds (see the module docstring).

    ``paths`` starts and releases path ids: an object with
    ``start_paths(token_ids, rows, ends, hashes) -> ids`` (row ``rows[i]``'s
    prompt is ``token_ids[rows[i], :ends[i]]``, its
    :func:`~consensus_spec.keymap.seq_hash` ``hashes[i]``) and
    ``release_paths(ids)``, such as
    :class:`~consensus_spec.drafting.ConsensusDrafter`, called at most once
    each per step; or a callable ``start_path(prompt) -> id``, with
    ``release_path(id)`` beside it. Each path the tracker forgets is
    released once. ``max_parked``: paths kept, in all, for rows that may
    resume them; ``max_per_key``: of those, paths with one same (length,
    hash), i.e. identical token sequences."""

    def __init__(self, paths, release_path: Callable | None = None,
                 max_parked: int = 4096, max_per_key: int = _MAX_PER_KEY,
                 token_limit: int = 1 << 62):
        if max_parked < 0 or max_per_key < 1 or token_limit < 1:
            raise ValueError("need max_parked >= 0, max_per_key >= 1 and token_limit >= 1")
        self._token_limit = token_limit  # ids at or above it (or < 0) make a row garbage
        K.kernel.compile()
        self._paths = paths if hasattr(paths, "start_paths") else _OnePathAtATime(paths, release_path)
        self._parked = Parked(max_parked, max_per_key)
        self._max_parked = max_parked
        self._max_per_key = max_per_key
        self._rows = 0
        self._grow(0, 0)
        self._flip = 0  # which of the two output buffers the last update filled
        self._counts = np.zeros(0, np.int64)  # row -> tokens sampled this step
        self._step_tokens = 0  # their sum
        self.paths_released = 0  # forgotten (handed to release_paths), never to resume
        self.paths_started = 0
        self.paths_resumed = 0  # taken back from the parked
        self.paths_moved = 0    # found in another row than last step
        self.tokens_missed = 0  # tokens generated while no propose call saw them
        self.rows_rejected = 0  # row-steps skipped for inconsistent inputs

    # per row: path (-1: none), path length (-1: none), state this step (K.IDLE...)
    _path = property(lambda self: self._rs[0])
    _lens = property(lambda self: self._rs[1])
    _state = property(lambda self: self._rs[2])
    _hash = property(lambda self: self._hs[0])  # hash of the path's whole sequence

    @property
    def num_parked(self) -> int:
        """Paths parked for rows that may resume them (at most ``max_parked``)."""
        return self._parked.num_parked

    @property
    def max_parked(self) -> int:
        return self._max_parked

    @property
    def num_parked_keys(self) -> int:
        """Distinct (length, hash) among the parked paths."""
        return self._parked.num_keys

    def parked(self) -> dict:
        """{(length, hash): paths, oldest first}, least recently parked key first."""
        return dict(self._parked.items())

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
        return self._rows

    def update(self, sampled_token_ids, num_tokens, token_ids) -> RowUpdate:
        """Where each row's new tokens are, and whose they are. Call once per step.
        Raises ValueError (and changes nothing) if the arguments' shapes don't fit."""
        num_rows = len(sampled_token_ids)
        # vLLM's arrays pass as they are (no copies, no conversions)
        ends = num_tokens if type(num_tokens) is ndarray else np.asarray(num_tokens)
        if type(token_ids) is not ndarray:
            token_ids = np.asarray(token_ids)
        if ends.ndim != 1 or len(ends) < num_rows or not (num_rows == 0 or _integers(ends)):
            raise ValueError(f"num_tokens: need {num_rows} integers, got {ends.dtype} {ends.shape}")
        if token_ids.ndim != 2 or len(token_ids) < num_rows or not _integers(token_ids):
            raise ValueError(f"token_ids: need {num_rows} rows of integers, "
                             f"got {token_ids.dtype} {token_ids.shape}")
        try:
            counts = np.fromiter(map(len, sampled_token_ids), np.int64, num_rows)
        except TypeError:  # an entry that is not a list: that row alone sits out
            counts = np.fromiter((_length(s) for s in sampled_token_ids), np.int64, num_rows)
        if len(ends) != num_rows:
            ends = ends[:num_rows]
        if ends.dtype.kind != "i":  # [] is float
            ends = ends.astype(np.int64)
        self._grow(num_rows, token_ids.shape[1])
        pk = self._parked
        pk.reserve(self._rows)  # a step parks at most a path per row
        self._counts = counts
        self._flip = flip = self._flip ^ 1
        out, contiguous = self._out[flip], self._contiguous[flip]
        (m, released, moved, missed, unresolved, rejected, resumed, self._step_tokens) = K.match(
            counts, ends, token_ids, self._token_limit, self._rs, self._hs, self._tails,
            self._window, self._flags, self._idx, self._scratch, out, contiguous, pk.keys,
            pk.paths, pk.table, pk.meta, pk.free, self._max_parked, self._max_per_key,
            self._released)
        o = self._views[flip]
        step = o.get(m)
        if step is None:  # views of the buffers, kept per length (a batch drains through few)
            step = RowUpdate(out[0, :m], out[1, :m], out[2, :m], out[3, :m], contiguous[:m])
            if len(o) >= 64:
                o.clear()
            o[m] = step
        if moved:
            self.paths_moved += moved
        if missed or rejected or resumed:
            self.tokens_missed += missed
            self.rows_rejected += rejected
            self.paths_resumed += resumed
        if released:
            self.paths_released += released
            self._paths.release_paths(self._released[:released].copy())
        if unresolved:
            self._start(step, token_ids, self._idx[1, :unresolved])
        return step

    def holding(self):
        """(rows, paths, lengths) of the rows holding a path after the last
        update: where each path's whole sequence is in the token buffer."""
        rows = np.flatnonzero((self._path >= 0) & (self._lens > 0))
        return rows, self._path[rows].copy(), self._lens[rows].copy()

    def accepted(self, rows, paths, sent) -> tuple[np.ndarray, int, int]:
        """For drafts sent last step (``sent[j]`` tokens to ``paths[j]`` in
        row ``rows[j]``), how many the verifier kept, judged from this step's
        update (the tracker's buffer: valid until the next call), and their
        sum, and the draft tokens judged. Rows that no longer hold their path
        contiguously count nothing and get ``sent[j] = 0`` (in place)."""
        accepted = self._accepted[:len(rows)]
        kept, judged = K.accepted(rows, paths, sent, self._path, self._state, self._counts,
                                  accepted)
        return accepted, kept, judged

    def _start(self, step: RowUpdate, token_ids, js) -> None:
        """New paths for the rows ``js`` of ``step``, which no former or
        parked path fits: every token before the first sampled one is the
        prompt (its hash: the row's window, K.match)."""
        rows = step.rows[js]
        ids = np.asarray(self._paths.start_paths(token_ids, rows, step.begins[js],
                                                 self._window[rows, 0]), np.int64)
        step.paths[js] = ids
        self._path[rows] = ids
        self.paths_started += len(js)

    def _grow(self, rows: int, width: int) -> None:
        """Per-row arrays for ``rows`` rows (kept: the largest batch seen)
        and scratch for token rows of ``width``."""
        if rows > self._rows or not self._rows:
            old, n = self._rows, max(rows, self._rows)
            rs = np.full((5, n), -1, np.int64)
            hs = np.zeros((2, n), np.uint64)
            tails = np.zeros((2, n, TAIL), np.int64)
            if old:
                rs[:2, :old] = self._rs[:2]
                hs[0, :old] = self._hs[0]
                tails[0, :old] = self._tails[0]
            rs[2] = 0
            self._rs, self._hs, self._tails = rs, hs, tails
            self._window = np.zeros((n, MAX_MISSED + 1), np.uint64)  # see K.match
            self._flags = np.zeros((2, n), np.bool_)
            self._idx = np.zeros((2, n), np.int64)
            self._out = np.zeros((2, 4, n), np.int64)  # two: last step's stay valid a step
            self._contiguous = np.zeros((2, n), np.bool_)
            self._released = np.zeros(2 * n + 2, np.int64)  # a park releases at most two
            self._accepted = np.zeros(n, np.int64)
            self._views = ({}, {})  # per output buffer: length -> RowUpdate of views (update)
            self._rows = n
            self._scratch = np.zeros(0, np.uint64)
        if len(self._scratch) < width + 1:
            self._scratch = np.zeros(width + 1, np.uint64)  # prefix hashes of one row
