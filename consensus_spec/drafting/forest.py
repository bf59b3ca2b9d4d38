"""A forest of bounded-depth suffix tries in one numba arena.

Per trie, the semantics of :class:`~tests.reference_trie.SuffixTrie`; but every
trie (each sibling group's, the cross-group one) is a root in shared arrays,
so one compiled call extends, or drafts for, all rows of a batch: a call per
row would cost more than the work.

``_nodes`` is ``(capacity, 7)`` int32, one row per node so its fields share a
cache line. Roots: depth 0, token -1, linked to themselves. A node's first
child sits in its row; only later ones go to an open-addressing table of
``(parent << 21 | token, child)`` int64 pairs (linear probing, at most half
full): deep nodes rarely branch, so new text mostly appends rows instead of
missing the cache on random hash slots, and the table is sized by those
edges, not by nodes. Both grow from Python before a call that could
overflow them, never inside one; past ``soft_capacity`` nodes the node array
grows only by what a call needs, as the caller is expected to compact.

Whole tries can be dropped (:meth:`SuffixForest.compact`): a separate int32
array holds each node's root, so rows stay 28 bytes and drafts never read it;
an append writes it once per new node.
"""

from __future__ import annotations

import numpy as np

from . import trie_kernels as K
from .trie_kernels import BEST, CNT, DEP, FIRST, LINK, TOK, TOT, UNSET  # noqa: F401  (the layout)


def _as_buffer(buffer) -> np.ndarray:
    buffer = np.asarray(buffer)
    if buffer.ndim != 2 or buffer.dtype.kind not in "iu":
        raise ValueError("token buffer must be a 2-D integer array")
    return buffer


def _new_table(size: int):
    return np.full((size, 2), -1, np.int64), 64 - (size.bit_length() - 1)


class SuffixForest:
    """Many suffix tries (one per root) sharing arrays and a ``max_depth``."""

    def __init__(self, max_depth: int = 12, capacity: int = 1 << 16,
                 soft_capacity: int | None = None):
        """``soft_capacity``: node count up to which the node array grows by
        doubling; past it, only by what a call needs (plus 1/64 of it), so an
        owner that compacts near this size never holds twice the memory."""
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        K.kernel.compile()
        self.max_depth = max_depth
        self.soft_capacity = soft_capacity
        cap = 2
        while cap < capacity:
            cap *= 2
        self._nodes = np.empty((cap, 7), np.int32)
        self._owner = np.empty(cap, np.int32)  # node -> its trie's root
        self._table, self._shift = _new_table(max(cap // 8, 64))
        self._state = np.zeros(2, np.int64)  # nodes, hashed edges
        self.tokens_appended = 0  # per sequence, by every call, ever

    def _reserve(self, new_nodes: int) -> None:
        """Room for ``new_nodes`` more nodes, each possibly a hashed edge."""
        n, hashed = int(self._state[0]), int(self._state[1])
        cap = len(self._nodes)
        if n + new_nodes > cap:
            while cap < n + new_nodes:
                cap *= 2
            soft = self.soft_capacity
            if soft is not None and cap > soft:
                cap = max(soft, n + new_nodes + soft // 64)
            nodes = np.empty((cap, 7), np.int32)  # the kernel writes every field of a new node
            nodes[:n] = self._nodes[:n]
            owner = np.empty(cap, np.int32)
            owner[:n] = self._owner[:n]
            self._nodes, self._owner = nodes, owner
        size = len(self._table)
        if 2 * (hashed + new_nodes) > size:  # keep the table at most half full
            while 2 * (hashed + new_nodes) > size:
                size *= 2
            table, shift = _new_table(size)
            K._rehash(self._table, table, shift)
            self._table, self._shift = table, shift

    def num_nodes(self) -> int:
        return int(self._state[0])

    @property
    def nbytes(self) -> int:
        """Bytes held by the node arrays and the edge table."""
        return self._nodes.nbytes + self._owner.nbytes + self._table.nbytes

    def root_sizes(self, roots) -> np.ndarray:
        """Nodes in each trie rooted at ``roots`` (what dropping it frees)."""
        return K._root_sizes(self._owner, self.num_nodes(), self._roots(roots))

    def compact(self, keep_roots) -> np.ndarray:
        """Drop every trie whose root is not in ``keep_roots``; keep the others
        unchanged but renumbered. Returns the old -> new node id map (int32,
        -1 for dropped nodes) to renumber ids held outside. The node array
        keeps its capacity; the table shrinks if now over 8x its edges."""
        keep = np.zeros(self.num_nodes(), np.bool_)
        keep[self._roots(keep_roots)] = True
        remap, edges = K._compact(self._nodes, self._owner, self._table, self._state, keep)
        size = len(self._table)
        while size > 64 and 8 * len(edges) <= size:  # the half would stay <= 1/4 full
            size //= 2
        if size == len(self._table):
            self._table.fill(-1)
        else:
            self._table, self._shift = _new_table(size)
        K._rehash(edges, self._table, self._shift)
        return remap

    def _roots(self, roots) -> np.ndarray:
        roots = np.asarray(roots, np.int64).reshape(-1)
        if roots.size and (roots.min() < 0 or roots.max() >= self.num_nodes()
                           or (self._nodes[roots, K.DEP] != 0).any()):
            raise ValueError("not a root of this forest")
        return roots

    def new_root(self) -> int:
        """Root of a new, empty trie."""
        self._reserve(1)
        r = int(self._state[0])
        self._nodes[r] = (-1, 0, 0, 0, -1, r, -1)
        self._owner[r] = r
        self._state[0] += 1
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
        their new nodes.

        ``buffer`` is any 2-D integer token array, such as vLLM's token
        buffer, so no per-row lists are built.
        """
        nodes = np.asarray(nodes, np.int64)
        rows, begins, ends = (np.asarray(a, np.int64) for a in (rows, begins, ends))
        if nodes.ndim != 2 or not len(nodes) == len(rows) == len(begins) == len(ends):
            raise ValueError("need nodes (R, S) and rows, begins, ends of length R")
        args = (nodes, _as_buffer(buffer), rows, begins, ends)
        out, _ = self._with_room(K._extend, args, nodes.shape[1])
        return out

    def extend_and_draft(self, cursors, ids, buffer, rows, begins, ends, max_tokens,
                         weight_b: float, min_prob: float, min_match: int, prior: float):
        """:meth:`extend_rows` then :meth:`draft_many` in one call, for
        sequences kept as rows of ``cursors``, a (P, 2) int64 array of
        (node in trie A, node in trie B or -1), updated in place: sequence
        ``ids[i]`` takes ``buffer[rows[i], begins[i]:ends[i]]``, then drafts
        at most ``max_tokens[i]`` tokens. Every sequence is extended before
        any drafts.

        Returns ``(tokens, probs, lengths)`` as :meth:`draft_many`, or None,
        changing nothing, if a selected cursor is ``UNSET`` (or A is -1).
        """
        ids, rows, begins, ends, max_tokens = (
            np.asarray(a, np.int64) for a in (ids, rows, begins, ends, max_tokens))
        if not len(ids) == len(rows) == len(begins) == len(ends) == len(max_tokens):
            raise ValueError("ids, rows, begins, ends and max_tokens must have equal length")
        if cursors.ndim != 2 or cursors.shape[1] != 2 or cursors.dtype != np.int64:
            raise ValueError("cursors must be a (P, 2) int64 array")
        args = (cursors, ids, _as_buffer(buffer), rows, begins, ends, max_tokens,
                float(weight_b), float(min_prob), int(min_match), float(prior))
        out, err = self._with_room(K._extend_draft, args, cursors.shape[1])
        return None if err == K._STALE else out

    def _with_room(self, extend_kernel, args, width: int):
        """Run a kernel that extends sequences (``width`` tries each), growing
        the arrays and running it again when it reports they are too small;
        returns (its outputs, 0 or ``K._STALE``) and raises on bad input."""
        while True:
            *out, err, total = extend_kernel(self._nodes, self._owner, self._table, self._shift,
                                             self._state, self.max_depth, *args)
            if err != K._FULL:
                break
            self._reserve(total * width * self.max_depth)
        if err == K._BAD_TOKEN:
            raise ValueError(f"token ids must be in [0, {K._TOKEN_LIMIT})")
        if err == K._BAD_INPUT:
            raise ValueError("node or sequence ids, rows or token ranges out of range")
        if not err:
            self.tokens_appended += total
        return (out[0] if len(out) == 1 else tuple(out)), err

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
        toks, probs, lens, err = K._draft(
            self._nodes, self._table, self._shift, self.num_nodes(), self.max_depth,
            nodes_a, nodes_b, float(weight_b), max_tokens, int(k), float(min_prob),
            int(min_match), float(prior))
        if err:
            raise ValueError("node ids out of range")
        return toks, probs, lens

    # Small accessors, mainly for tests.
    def depth(self, node: int) -> int:
        return int(self._nodes[node, K.DEP])

    def count(self, node: int) -> int:
        return int(self._nodes[node, K.CNT])

    def root(self, node: int) -> int:
        """Root of the trie ``node`` belongs to."""
        return int(self._owner[node])

    def child(self, node: int, token: int) -> int:
        """Child of ``node`` along ``token``, or -1."""
        return int(K._child(self._nodes, self._table, self._shift, int(node), int(token)))
