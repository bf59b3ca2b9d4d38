"""Compiled kernels of :class:`~consensus_spec.drafting.forest.SuffixForest`:
appending, drafting and compaction over the shared node arena (layout in the
forest module's docstring). Python calls them through this module's
attributes, which :meth:`Kernels.compile` swaps for their compiled versions."""


from __future__ import annotations

import numpy as np

from ..jit import Kernels

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
