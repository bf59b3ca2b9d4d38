"""A forest of bounded-depth suffix tries in one numba arena.

Per trie, the semantics of :class:`~consensus_spec.trie.SuffixTrie`; but every
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

from .jit import Kernels

_TOKEN_BITS = 21
_TOKEN_LIMIT = 1 << _TOKEN_BITS
TOK, DEP, CNT, TOT, BEST, LINK, FIRST = range(7)  # columns of the node array
_FIB = np.uint64(0x9E3779B97F4A7C15)      # Fibonacci hashing multiplier
_BAD_TOKEN, _BAD_INPUT, _STALE, _FULL = -1, -2, -3, -4
UNSET = -2  # a cursor that points into no trie yet (see extend_and_draft)


kernel = Kernels(globals())


@kernel
def _probe(table, shift, key):
    """Slot holding ``key``, or the empty slot where it would go."""
    mask = table.shape[0] - 1
    i = np.int64((np.uint64(key) * _FIB) >> np.uint64(shift))
    while table[i, 0] != key and table[i, 0] >= 0:
        i = (i + 1) & mask
    return i


@kernel
def _rehash(old, new, shift):
    for i in range(old.shape[0]):
        if old[i, 0] >= 0:
            s = _probe(new, shift, old[i, 0])
            new[s, 0] = old[i, 0]
            new[s, 1] = old[i, 1]


@kernel
def _child(nodes, table, shift, node, tok):
    """``node``'s child along ``tok``, or -1."""
    f = nodes[node, FIRST]
    if f < 0 or nodes[f, TOK] == tok:
        return np.int64(f)
    if nodes[node, TOT] == nodes[f, CNT]:  # the first child is the only one
        return -1
    key = (np.int64(node) << _TOKEN_BITS) | tok
    s = _probe(table, shift, key)
    return table[s, 1] if table[s, 0] == key else -1


@kernel
def _step(nodes, table, shift, max_depth, node, tok):
    """Longest suffix of (node's string + tok) present in node's trie."""
    while True:
        if nodes[node, DEP] < max_depth:
            c = _child(nodes, table, shift, node, tok)
            if c >= 0:
                return c
        if nodes[node, DEP] == 0:
            return np.int64(node)
        node = nodes[node, LINK]


@kernel
def _top(nodes, node, min_depth):
    """Context node whose best child is the draft (backing off), or -1."""
    while nodes[node, TOT] == 0 and nodes[node, DEP] > min_depth:
        node = nodes[node, LINK]
    if nodes[node, TOT] == 0 or nodes[node, DEP] < min_depth:
        return -1
    return node


@kernel
def _append(nodes, owner, table, shift, state, max_depth, node, buf, row, begin, end):
    """Append ``buf[row, begin:end]`` to the sequence at ``node``; its new node."""
    n_nodes, n_hashed = state[0], state[1]
    root = owner[node]  # every node this creates is in node's trie
    for j in range(begin, end):
        tok = buf[row, j]
        deepest = -1
        prev = -1
        found = False
        n = node
        while True:  # every suffix of the sequence, longest first
            if nodes[n, DEP] < max_depth:
                if found:  # below an existing node, its suffix links are the
                    c = np.int64(nodes[prev, LINK])  # children: no lookup
                else:
                    c = _child(nodes, table, shift, n, tok)
                    found = c >= 0
                if not found:
                    c = n_nodes
                    n_nodes += 1
                    nodes[c, TOK], nodes[c, DEP] = tok, nodes[n, DEP] + 1
                    nodes[c, CNT], nodes[c, TOT] = 0, 0
                    nodes[c, BEST], nodes[c, FIRST] = -1, -1
                    owner[c] = root
                    if nodes[n, FIRST] < 0:
                        nodes[n, FIRST] = c
                    else:
                        key = (np.int64(n) << _TOKEN_BITS) | tok
                        h = _probe(table, shift, key)
                        table[h, 0] = key
                        table[h, 1] = c
                        n_hashed += 1
                nodes[c, CNT] += 1
                nodes[n, TOT] += 1
                b = nodes[n, BEST]
                if b < 0 or (b != c and nodes[c, CNT] > nodes[b, CNT]):
                    nodes[n, BEST] = c
                if prev >= 0:
                    nodes[prev, LINK] = c
                else:
                    deepest = c
                prev = c
            if nodes[n, DEP] == 0:
                break
            n = nodes[n, LINK]
        nodes[prev, LINK] = n  # the depth-1 node links to its own root
        node = deepest
    state[0], state[1] = n_nodes, n_hashed
    return node


@kernel
def _check_ranges(n_nodes, starts, buf, rows, begins, ends):
    """0, or why the input is bad (checked before anything changes)."""
    for i in range(starts.shape[0]):
        if not (0 <= rows[i] < buf.shape[0] and 0 <= begins[i] <= ends[i] <= buf.shape[1]):
            return _BAD_INPUT
        for s in range(starts.shape[1]):
            if starts[i, s] < -1 or starts[i, s] >= n_nodes:
                return _BAD_INPUT
        for j in range(begins[i], ends[i]):
            if buf[rows[i], j] < 0 or buf[rows[i], j] >= _TOKEN_LIMIT:
                return _BAD_TOKEN
    return 0


@kernel
def _extend(nodes, owner, table, shift, state, max_depth, starts, buf, rows, begins, ends):
    """Append ``buf[rows[i], begins[i]:ends[i]]`` to each sequence ``starts[i, s]``
    (-1: none). Returns (new nodes, error or 0, tokens per sequence); on
    ``_FULL`` nothing changed and the arrays need room for that many tokens."""
    out = starts.copy()
    err = _check_ranges(state[0], starts, buf, rows, begins, ends)
    if err:
        return out, err, 0
    total = 0
    for i in range(starts.shape[0]):
        total += ends[i] - begins[i]
    need = total * starts.shape[1] * max_depth
    if state[0] + need > nodes.shape[0] or 2 * (state[1] + need) > table.shape[0]:
        return out, _FULL, total
    for i in range(starts.shape[0]):
        for s in range(starts.shape[1]):
            if starts[i, s] >= 0:
                out[i, s] = _append(nodes, owner, table, shift, state, max_depth, starts[i, s],
                                    buf, rows[i], begins[i], ends[i])
    return out, 0, total


@kernel
def _draft_row(nodes, table, shift, max_depth, a, b, weight_b, max_tokens,
               min_prob, min_match, prior, toks, probs):
    """Joint greedy walk from ``a`` (weight 1) and ``b``; the draft's length."""
    if weight_b <= 0:
        b = -1
    p = 1.0
    n = 0
    while n < max_tokens:
        from_b, prob, child = False, 0.0, np.int64(-1)
        ctx = _top(nodes, a, min_match) if a >= 0 else -1
        score = 0.0
        if ctx >= 0:
            child = np.int64(nodes[ctx, BEST])
            prob = nodes[child, CNT] / (nodes[ctx, TOT] + prior)
            score = prob * (1 + nodes[ctx, DEP])
        if b >= 0:  # B must score strictly higher
            ctx = _top(nodes, b, min_match)
            if ctx >= 0:
                c = np.int64(nodes[ctx, BEST])
                prob_b = nodes[c, CNT] / (nodes[ctx, TOT] + prior)
                if weight_b * prob_b * (1 + nodes[ctx, DEP]) > score:
                    from_b, prob, child = True, prob_b, c
        if child < 0:
            break
        p *= prob
        if p < min_prob:
            break
        tok = nodes[child, TOK]
        toks[n] = tok
        probs[n] = p
        n += 1
        if from_b:
            b = child
            a = _step(nodes, table, shift, max_depth, a, tok) if a >= 0 else a
        else:
            a = child
            b = _step(nodes, table, shift, max_depth, b, tok) if b >= 0 else b
    return n


@kernel
def _draft(nodes, table, shift, n_nodes, max_depth, nodes_a, nodes_b, weight_b,
           max_tokens, k, min_prob, min_match, prior):
    rows = nodes_a.shape[0]
    toks = np.zeros((rows, k), np.int32)
    probs = np.zeros((rows, k), np.float64)
    lens = np.zeros(rows, np.int32)
    for i in range(rows):
        if not (-1 <= nodes_a[i] < n_nodes and -1 <= nodes_b[i] < n_nodes):
            return toks, probs, lens, _BAD_INPUT
    for i in range(rows):
        lens[i] = _draft_row(nodes, table, shift, max_depth, nodes_a[i], nodes_b[i], weight_b,
                             min(max_tokens[i], k), min_prob, min_match, prior,
                             toks[i], probs[i])
    return toks, probs, lens, 0


@kernel
def _extend_draft(nodes, owner, table, shift, state, max_depth, cursors, ids, buf, rows, begins,
                  ends, max_tokens, weight_b, min_prob, min_match, prior):
    m = ids.shape[0]
    k = 0
    for i in range(m):
        k = max(k, max_tokens[i])
    toks = np.zeros((m, k), np.int32)
    probs = np.zeros((m, k), np.float64)
    lens = np.zeros(m, np.int32)
    for i in range(m):
        if not 0 <= ids[i] < cursors.shape[0]:
            return toks, probs, lens, _BAD_INPUT, 0
        if cursors[ids[i], 0] < 0 or cursors[ids[i], 1] < -1:
            return toks, probs, lens, _STALE, 0
    starts = np.empty((m, cursors.shape[1]), np.int64)
    for i in range(m):
        starts[i] = cursors[ids[i]]
    # every row's tokens go in before any row drafts
    out, err, total = _extend(nodes, owner, table, shift, state, max_depth, starts, buf, rows,
                              begins, ends)
    if err:
        return toks, probs, lens, err, total
    for i in range(m):
        cursors[ids[i]] = out[i]
    for i in range(m):
        c = cursors[ids[i]]
        lens[i] = _draft_row(nodes, table, shift, max_depth, c[0], c[1], weight_b,
                             min(max_tokens[i], k), min_prob, min_match, prior, toks[i], probs[i])
    return toks, probs, lens, 0, total


@kernel
def _root_sizes(owner, n_nodes, roots):
    """Nodes in each of the tries rooted at ``roots``."""
    index = np.full(n_nodes, -1, np.int32)
    index[roots] = np.arange(roots.shape[0], dtype=np.int32)
    sizes = np.zeros(roots.shape[0], np.int64)
    for i in range(n_nodes):
        if index[owner[i]] >= 0:
            sizes[index[owner[i]]] += 1
    return sizes


@kernel
def _compact(nodes, owner, table, state, keep):
    """Keep the nodes whose root is marked in ``keep`` (by node id), moved
    down in order (in place: a new id is never above the old one), with
    their ids renumbered; returns the old -> new map (-1: dropped) and the
    kept hashed edges, renumbered, for a cleared table. A trie's links and
    children stay inside it, and its root comes first, so all are mapped."""
    remap = np.empty(state[0], np.int32)
    m = 0
    for i in range(state[0]):
        remap[i] = -1
        if keep[owner[i]]:
            remap[i] = m
            for c in range(nodes.shape[1]):  # rows below i are already read
                nodes[m, c] = nodes[i, c]
            owner[m] = remap[owner[i]]
            m += 1
    for j in range(m):
        for c in (BEST, LINK, FIRST):
            if nodes[j, c] >= 0:
                nodes[j, c] = remap[nodes[j, c]]
    edges = np.empty((state[1], 2), np.int64)
    e = 0
    for s in range(table.shape[0]):
        parent = table[s, 0] >> _TOKEN_BITS
        if table[s, 0] >= 0 and remap[parent] >= 0:
            tok = table[s, 0] & (_TOKEN_LIMIT - 1)
            edges[e, 0] = (np.int64(remap[parent]) << _TOKEN_BITS) | tok
            edges[e, 1] = remap[table[s, 1]]
            e += 1
    state[0], state[1] = m, e
    return remap, edges[:e]


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
        kernel.compile()
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
            _rehash(self._table, table, shift)
            self._table, self._shift = table, shift

    def num_nodes(self) -> int:
        return int(self._state[0])

    @property
    def nbytes(self) -> int:
        """Bytes held by the node arrays and the edge table."""
        return self._nodes.nbytes + self._owner.nbytes + self._table.nbytes

    def root_sizes(self, roots) -> np.ndarray:
        """Nodes in each trie rooted at ``roots`` (what dropping it frees)."""
        return _root_sizes(self._owner, self.num_nodes(), self._roots(roots))

    def compact(self, keep_roots) -> np.ndarray:
        """Drop every trie whose root is not in ``keep_roots``; keep the others
        unchanged but renumbered. Returns the old -> new node id map (int32,
        -1 for dropped nodes) to renumber ids held outside. The node array
        keeps its capacity; the table shrinks if now over 8x its edges."""
        keep = np.zeros(self.num_nodes(), np.bool_)
        keep[self._roots(keep_roots)] = True
        remap, edges = _compact(self._nodes, self._owner, self._table, self._state, keep)
        size = len(self._table)
        while size > 64 and 8 * len(edges) <= size:  # the half would stay <= 1/4 full
            size //= 2
        if size == len(self._table):
            self._table.fill(-1)
        else:
            self._table, self._shift = _new_table(size)
        _rehash(edges, self._table, self._shift)
        return remap

    def _roots(self, roots) -> np.ndarray:
        roots = np.asarray(roots, np.int64).reshape(-1)
        if roots.size and (roots.min() < 0 or roots.max() >= self.num_nodes()
                           or (self._nodes[roots, DEP] != 0).any()):
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
        out, _ = self._with_room(_extend, args, nodes.shape[1])
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
        out, err = self._with_room(_extend_draft, args, cursors.shape[1])
        return None if err == _STALE else out

    def _with_room(self, extend_kernel, args, width: int):
        """Run a kernel that extends sequences (``width`` tries each), growing
        the arrays and running it again when it reports they are too small;
        returns (its outputs, 0 or ``_STALE``) and raises on bad input."""
        while True:
            *out, err, total = extend_kernel(self._nodes, self._owner, self._table, self._shift,
                                             self._state, self.max_depth, *args)
            if err != _FULL:
                break
            self._reserve(total * width * self.max_depth)
        if err == _BAD_TOKEN:
            raise ValueError(f"token ids must be in [0, {_TOKEN_LIMIT})")
        if err == _BAD_INPUT:
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
        toks, probs, lens, err = _draft(
            self._nodes, self._table, self._shift, self.num_nodes(), self.max_depth,
            nodes_a, nodes_b, float(weight_b), max_tokens, int(k), float(min_prob),
            int(min_match), float(prior))
        if err:
            raise ValueError("node ids out of range")
        return toks, probs, lens

    # Small accessors, mainly for tests.
    def depth(self, node: int) -> int:
        return int(self._nodes[node, DEP])

    def count(self, node: int) -> int:
        return int(self._nodes[node, CNT])

    def root(self, node: int) -> int:
        """Root of the trie ``node`` belongs to."""
        return int(self._owner[node])

    def child(self, node: int, token: int) -> int:
        """Child of ``node`` along ``token``, or -1."""
        return int(_child(self._nodes, self._table, self._shift, int(node), int(token)))
