"""A forest of bounded-depth suffix tries in one numba arena of two halves.

Per trie, the semantics of :class:`~tests.reference_trie.SuffixTrie`; but every
trie (each sibling group's, the cross-group one) is a root in shared arrays,
so one compiled call extends, or drafts for, all rows of a batch: a call per
row would cost more than the work.

``_nodes`` is ``(capacity, 7)`` int32, one row per node so its fields share a
cache line. Roots: depth 0, token -1, linked to themselves. A node's first
child sits in its row; only later ones go to an open-addressing table of
``(parent << 21 | token) + 1 -> child`` int64 pairs (0: empty; linear
probing, at most half full): deep nodes rarely branch, so new text mostly
appends rows instead of missing the cache on random hash slots.

No pause, ever: the arrays are allocated once, at full size, and never grow
or get compacted. The node array is split into two halves, each with its own
edge table. New tries start in the *young* half; a trie, and everything
appended to it, stays in the half it started in. :meth:`rotate` drops the
other half whole: its nodes are simply reused and its table swapped for a
spare one that :meth:`tidy` cleared a slice a step, so dropping millions of
nodes costs microseconds. Memory is committed by the OS as pages are first
written, so an arena that never fills never costs its full size, unless
:meth:`commit` backs it all at once, in huge pages where it can (the
proposer does, at start: a server's memory then does not grow as its arena
fills, and its walks miss the TLB less).
"""

from __future__ import annotations

import mmap

import numpy as np

from . import trie_kernels as K
from .trie_kernels import BEST, CNT, DEP, FIRST, LINK, TOK, TOT, UNSET  # noqa: F401  (the layout)

PAGE_SLOTS = 4096 // 16  # edge-table slots in a 4 KB page
TIDY_SLOTS = 1 << 14     # table slots tidy() clears a call (256 KB, ~20 us)
TOKEN_LIMIT = K.TOKEN_LIMIT  # token ids must be below it
EDGES_PER_NODE = 0.25  # table slots per node are half this (load <= 1/2)


class ForestFull(Exception):
    """A call needs more nodes or edges than its tries' half has left; the
    owner rotates (:meth:`SuffixForest.rotate`) and calls again."""

    def __init__(self, half: int):
        super().__init__(f"half {half} of the trie arena is full")
        self.half = half


_PRIVATE = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_HUGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
_NO_HUGE = getattr(mmap, "MADV_NOHUGEPAGE", None)


def _anonymous(shape: tuple, dtype) -> np.ndarray:
    """A zero-filled array in its own private anonymous mapping: the OS
    commits 4 KB pages as first written and takes them back when the array
    is dropped. Not numpy's allocator, and no huge pages until
    :meth:`SuffixForest.commit` asks for them (where every such fault
    happens at once, before the first step): a huge-page fault that
    compacts memory stalls the writer for milliseconds (every 2 MB of new
    nodes, measured: ~5 ms). Linux may still merge the mapping with an
    adjacent one (the arena's edge tables and spare come as one): count the
    arena's memory by its ranges together, or page by page."""
    count = int(np.prod(shape))
    size = max(count * np.dtype(dtype).itemsize, 1)
    buf = mmap.mmap(-1, size, flags=_PRIVATE) if _PRIVATE else mmap.mmap(-1, size)
    _advise(buf, _NO_HUGE)
    # One page written now gives the mapping an anonymous memory object before
    # commit()'s advice: without it a committed arena merged into an older
    # forest's mapping (8f16e07). It does not keep every mapping apart.
    buf[0] = 0
    return np.frombuffer(buf, dtype, count=count).reshape(shape)


def _advise(buf: mmap.mmap, advice: int | None) -> bool:
    """``buf.madvise(advice)``; whether the OS took it (an OS without
    transparent huge pages leaves 4 KB pages: the same arrays, slower)."""
    if advice is None:
        return False
    try:
        buf.madvise(advice)
    except (OSError, ValueError):
        return False
    return True


def _mapping(array: np.ndarray) -> mmap.mmap | None:
    """The mapping under an array :func:`_anonymous` made (or a view of it)."""
    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return base


def _as_buffer(buffer) -> np.ndarray:
    buffer = np.asarray(buffer)
    if buffer.ndim != 2 or buffer.dtype.kind not in "iu":
        raise ValueError("token buffer must be a 2-D integer array")
    return buffer


class SuffixForest:
    """Many suffix tries (one per root) sharing arrays and a ``max_depth``;
    at most ``capacity`` nodes, half of them in each half of the arena."""

    def __init__(self, max_depth: int = 12, capacity: int = 1 << 16):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if capacity < 128:
            raise ValueError(f"capacity must be >= 128 nodes, got {capacity}")
        K.kernel.compile()
        self.max_depth = max_depth
        self.half = capacity // 2  # first node id of half 1
        slots = 64
        while slots < self.half * EDGES_PER_NODE * 2:
            slots *= 2
        self._slots = slots
        self._shift = 64 - (slots.bit_length() - 1)
        self._nodes = _anonymous((2 * self.half, 7), np.int32)
        self._tables = [self._new_table(), self._new_table()]
        # The table the next young half takes: zeroed, its pages committed,
        # by tidy() a slice a step (freeing or clearing 32 MB at once is ~6 ms).
        self._spare, self._spare_done = self._new_table(), 0
        self._dirty = None  # the dropped half's table, until tidy() has cleared it
        self._state = np.array([[0, 0], [self.half, 0]], np.int64)  # per half: next id, edges
        self.young = 0  # the half new tries start in
        self.meta = np.zeros(1, np.int64)  # tokens appended (per sequence), by every call, ever
        self.huge_pages = False  # the OS took commit()'s request for transparent huge pages
        self._grow_drafts(64, 8)  # the drafter's step outputs and scratch

    def _new_table(self) -> np.ndarray:
        return _anonymous((self._slots, 2), np.int64)

    @property
    def old(self) -> int:
        return 1 - self.young

    @property
    def tokens_appended(self) -> int:
        """Tokens appended (once per sequence they went to), by every call, ever."""
        return int(self.meta[0])

    @property
    def tidy_pending(self) -> bool:
        """Whether :meth:`tidy` may have work to do (a dropped half's table to
        clear, or a spare table's pages to write)."""
        return self._dirty is not None or self._spare_done < self._slots

    def arena(self) -> tuple:
        """``(nodes, t0, t1, shift, half)``: the arena as the public kernels of
        :mod:`.trie_kernels` take it (valid until the next :meth:`rotate`)."""
        return (self._nodes, *self._tables, self._shift, self.half)

    def num_nodes(self, half: int | None = None) -> int:
        """Nodes in use, in ``half`` or in both."""
        if half is None:
            return self.num_nodes(0) + self.num_nodes(1)
        return int(self._state[half, 0]) - half * self.half

    def fill(self, half: int) -> float:
        """Share of ``half``'s nodes or edges in use, whichever is higher."""
        return max(self.num_nodes(half) / self.half, 2 * int(self._state[half, 1]) / self._slots)

    def half_of(self, nodes) -> np.ndarray:
        """0 or 1 per node id (ids must be >= 0)."""
        return (np.asarray(nodes) >= self.half).astype(np.int64)

    @property
    def nbytes(self) -> int:
        """Bytes of the node array and the three edge tables (one per half,
        one spare), at full size: the bound on what the forest can hold."""
        return self._nodes.nbytes + 3 * self._tables[0].nbytes

    def rotate(self) -> int:
        """Drop every trie in the old half and make it the young one; returns
        its index. Node ids in it are reused: ids held outside must be
        forgotten by the caller. O(1) unless tidy() has not finished
        clearing the last dropped table (a rotation within a few hundred
        steps of the last)."""
        h = self.old
        while self._spare is None:
            self.tidy(self._slots)
        self._state[h] = h * self.half, 0
        self._tables[h], self._dirty = self._spare, self._tables[h]
        self._spare, self._spare_done = None, 0
        self.young = h
        return h

    def commit(self) -> None:
        """Back every page of the arrays now, rewriting what they hold (safe
        at any time): the forest's resident memory is its full size
        (:attr:`nbytes`) from here on, instead of growing towards it as nodes
        and edges are first written, and no later call faults a page in.
        Backed by transparent huge pages where the OS gives them
        (:attr:`huge_pages`): a trie walk is a chain of random reads over
        hundreds of MB, and with 4 KB pages most of them also miss the TLB
        (docs/host_time.md, "Huge pages")."""
        for a in [self._nodes, *self._tables, self._spare, self._dirty]:
            if a is not None:
                buf = _mapping(a)
                self.huge_pages = (buf is not None and _advise(buf, _HUGE)) or self.huge_pages
                flat = a.reshape(-1)
                step = max(1, 4096 // a.itemsize)
                view = flat[::step]
                np.add(view, 0, out=view)  # a write per page (a bare self-assignment is skipped)
        if self._dirty is None:
            self._spare_done = self._slots  # the spare's pages need no more writing

    def tidy(self, slots: int = TIDY_SLOTS, young_half_full: bool | None = None) -> None:
        """Bounded work a step, off the hot path: clear the next ``slots`` of
        the dropped half's edge table, or, once the young half is half full
        (a rotation is coming), write the next ones of a fresh spare table,
        so its pages are committed before it is used, not one page fault per
        random insert, and not before they are needed. ``young_half_full``:
        whether the young half is past half full, if the caller knows."""
        if self._dirty is not None:
            start = self._spare_done
            end = min(start + slots, self._slots)
            self._dirty[start:end] = 0
            self._spare_done = end
            if end == self._slots:
                self._spare, self._dirty, self._spare_done = self._dirty, None, self._slots
        elif self._spare_done < self._slots and (
                self.fill(self.young) > 0.5 if young_half_full is None else young_half_full):
            start = self._spare_done
            pages = max(1, slots * 16 // 4096)  # as many pages as clearing writes, one slot each
            end = min(start + pages * PAGE_SLOTS, self._slots)
            self._spare[start:end:PAGE_SLOTS, 1] = 0
            self._spare_done = end

    def root_sizes(self, roots) -> np.ndarray:
        """Nodes in each trie rooted at ``roots`` (slow: for tests and reports)."""
        return K.root_sizes(self._nodes, self._state, self.half, self._roots(roots))

    def _roots(self, roots) -> np.ndarray:
        roots = np.asarray(roots, np.int64).reshape(-1)
        for r in roots.tolist():
            h = int(r >= self.half)
            if not (h * self.half <= r < self._state[h, 0]) or self._nodes[r, DEP] != 0:
                raise ValueError("not a root of this forest")
        return roots

    def new_root(self) -> int:
        """Root of a new, empty trie, in the young half."""
        h = self.young
        r = int(self._state[h, 0])
        if r + 1 > (h + 1) * self.half:
            raise ForestFull(h)
        self._nodes[r] = (-1, 0, 0, 0, -1, r, -1)
        self._state[h, 0] += 1
        return r

    def extend_many(self, nodes, tokens, offsets) -> np.ndarray:
        """Append ``tokens[offsets[i]:offsets[i+1]]`` to the sequence whose
        longest-suffix node is ``nodes[i]`` (its trie's root for a new one);
        returns each sequence's new longest-suffix node."""
        nodes = np.asarray(nodes, np.int64)
        offsets = np.asarray(offsets, np.int64)
        if nodes.ndim != 1 or offsets.shape != (len(nodes) + 1,):
            raise ValueError("need len(offsets) == len(nodes) + 1")
        tokens = np.asarray(tokens, np.int32).reshape(1, -1)
        rows = np.zeros(len(nodes), np.int64)
        return self.extend_rows(nodes[:, None], tokens, rows, offsets[:-1], offsets[1:])[:, 0]

    def extend_rows(self, nodes, buffer, rows, begins, ends) -> np.ndarray:
        """Append ``buffer[rows[i], begins[i]:ends[i]]`` to each of the
        sequences whose longest-suffix nodes are ``nodes[i, :]`` (an (R, S)
        array: S tries take the same tokens; -1 is no sequence); returns
        their new nodes. Raises :class:`ForestFull`, changing nothing, if a
        half could run out of room.

        ``buffer`` is any 2-D integer token array, such as vLLM's token
        buffer, so no per-row lists are built.
        """
        nodes = np.asarray(nodes, np.int64)
        rows, begins, ends = (np.asarray(a, np.int64) for a in (rows, begins, ends))
        if nodes.ndim != 2 or not len(nodes) == len(rows) == len(begins) == len(ends):
            raise ValueError("need nodes (R, S) and rows, begins, ends of length R")
        out, _ = self._run(K.extend, (nodes, _as_buffer(buffer), rows, begins, ends))
        return out

    def _grow_drafts(self, rows: int, width: int) -> None:
        """Draft buffers for at least ``rows`` rows of ``width`` tokens, the
        drafter's step writes into (:func:`.path_kernels.extend_and_draft`;
        powers of two: they grow a few times in an engine's life)."""
        r, w = 64, 8
        while r < rows:
            r *= 2
        while w < width:
            w *= 2
        self._toks = np.zeros(r * w, np.int32)
        self.draft_views = {}  # (rows, k) -> (tokens, probs, lengths) views of these (the drafter's)
        self._probs = np.zeros(r * w, np.float64)
        self._lens = np.zeros(r, np.int32)
        self._starts = np.zeros((r, 2), np.int64)
        self._memo = np.zeros(2 * r, np.int64)

    def room(self, rotate_at: float, old_full_at: float) -> int:
        """:meth:`fill` of both halves in one call: bit 1 set if the young
        half is more than ``rotate_at`` full or the old one more than
        ``old_full_at``; bit 2 if the young one is more than half full."""
        return K.room(self._state, self.half, self._slots, self.young, rotate_at, old_full_at)

    def _run(self, extend_kernel, args):
        """Run a kernel that extends sequences; returns (its outputs, 0 or
        ``K.STALE``) and raises on bad input or a full half."""
        t0, t1 = self._tables
        *out, err, total, full = extend_kernel(self._nodes, t0, t1, self._shift, self.half,
                                               self._state, self.max_depth, *args)
        self._raise(err, total, full)
        return (out[0] if len(out) == 1 else tuple(out)), err

    def _raise(self, err: int, total: int, full: int) -> None:
        """Raise on bad input or a full half; count the tokens appended."""
        if err == K.FULL:
            raise ForestFull(int(full))
        self.raise_for(err)
        if not err:
            self.meta[0] += total

    @staticmethod
    def raise_for(err: int) -> None:
        """ValueError for a kernel's bad-input error codes."""
        if err == K.BAD_TOKEN:
            raise ValueError(f"token ids must be in [0, {K.TOKEN_LIMIT})")
        if err == K.BAD_INPUT:
            raise ValueError("node or sequence ids, rows or token ranges out of range")

    def draft_many(self, nodes_a, nodes_b, weight_b: float, max_tokens, k: int,
                   min_prob: float, min_match: int, prior: float):
        """Per row, :meth:`ConsensusDrafter.draft`'s joint greedy walk over
        source A (weight 1) and B (``weight_b``; -1 = no such source).

        Returns ``(tokens (R, k) int32, cumulative probs (R, k) float64,
        lengths (R,) int32)``; entries past a row's length are 0.
        """
        nodes_a = np.asarray(nodes_a, np.int64)
        nodes_b = np.asarray(nodes_b, np.int64)
        max_tokens = np.asarray(max_tokens, np.int32)
        if not nodes_a.shape == nodes_b.shape == max_tokens.shape or nodes_a.ndim != 1:
            raise ValueError("nodes_a, nodes_b and max_tokens must be equal-length 1-D")
        t0, t1 = self._tables
        toks, probs, lens, err = K.draft(
            self._nodes, t0, t1, self._shift, self.half, self._state, self.max_depth,
            nodes_a, nodes_b, float(weight_b), max_tokens, int(k), float(min_prob),
            int(min_match), float(prior))
        if err:
            raise ValueError("node ids out of range")
        return toks, probs, lens

    def counts_snapshot(self) -> tuple:
        """(next node id per half, each half's nodes' total counts): what
        :meth:`changed_since` compares with (a replay's table refresh)."""
        ends = self._state[:, 0].copy()
        return ends, [self._nodes[h * self.half:ends[h], K.TOT].copy() for h in (0, 1)]

    def changed_since(self, snapshot: tuple) -> np.ndarray:
        """Node ids whose total count changed since :meth:`counts_snapshot`,
        then those added since, per half (meaningless across a :meth:`rotate`
        that dropped a half: its ids are reused)."""
        ends0, totals0 = snapshot
        ends1 = self._state[:, 0]
        return np.concatenate([np.concatenate([
            h * self.half + np.flatnonzero(self._nodes[h * self.half:ends0[h], K.TOT] != totals0[h]),
            np.arange(ends0[h], ends1[h])]) for h in (0, 1)])

    # Small accessors, mainly for tests.
    def depth(self, node: int) -> int:
        return int(self._nodes[node, K.DEP])

    def count(self, node: int) -> int:
        return int(self._nodes[node, K.CNT])

    def root(self, node: int) -> int:
        """Root of the trie ``node`` belongs to (up the suffix links)."""
        while self._nodes[node, K.DEP] > 0:
            node = int(self._nodes[node, K.LINK])
        return int(node)

    def child(self, node: int, token: int) -> int:
        """Child of ``node`` along ``token``, or -1."""
        t0, t1 = self._tables
        return int(K.child(self._nodes, t0, t1, self._shift, self.half, int(node), int(token)))
