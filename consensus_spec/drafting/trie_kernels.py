"""Compiled kernels of :class:`~consensus_spec.drafting.forest.SuffixForest`:
appending and drafting over the shared node arena (layout in the
forest module's docstring). Python calls them through this module's
attributes, which :meth:`Kernels.compile` swaps for their compiled versions.

The public ones are the trie's face for other compiled code (the drafter's
path kernels, the lagged tries of the device route, the replay's device
emulation): :func:`child`, :func:`advance`, :func:`append`,
:func:`extend_into`, :func:`draft_into` and :func:`room`. Each takes the
arena as ``nodes, t0, t1, shift, half`` (:meth:`SuffixForest.arena` gives
them), and ``state`` and ``max_depth`` where it writes or walks."""


from __future__ import annotations

import numpy as np

from ..jit import Kernels, prefetch

TOKEN_BITS = 21
TOKEN_LIMIT = 1 << TOKEN_BITS
TOK, DEP, CNT, TOT, BEST, LINK, FIRST = range(7)  # columns of the node array
_FIB = np.uint64(0x9E3779B97F4A7C15)      # Fibonacci hashing multiplier
BAD_TOKEN, BAD_INPUT, STALE, FULL, SMALL = -1, -2, -3, -4, -5  # errors kernels return
UNSET = -2  # a cursor that points into no trie yet (see extend_and_draft)


kernel = Kernels(globals())


@kernel
def _probe(table, shift, key):
    """Slot holding stored ``key`` (> 0), or the empty slot (0) where it would go."""
    mask = table.shape[0] - 1
    i = np.int64((np.uint64(key) * _FIB) >> np.uint64(shift))
    while table[i, 0] != key and table[i, 0] != 0:
        i = (i + 1) & mask
    return i


@kernel
def child(nodes, t0, t1, shift, half, node, tok):
    """``node``'s child along token ``tok``, or -1: the first child from the
    node's row, any other from its half's edge table."""
    f = nodes[node, FIRST]
    if f < 0 or nodes[f, TOK] == tok:
        return np.int64(f)
    if nodes[node, TOT] == nodes[f, CNT]:  # the first child is the only one
        return -1
    key = ((np.int64(node) << TOKEN_BITS) | tok) + 1  # stored + 1: 0 marks an empty slot
    table = t0 if node < half else t1
    s = _probe(table, shift, key)
    return table[s, 1] if table[s, 0] == key else -1


@kernel
def advance(nodes, t0, t1, shift, half, max_depth, node, tok):
    """The context after reading ``tok`` at context ``node``: the node of
    the longest suffix of (node's string + tok) present in node's trie, at
    most ``max_depth`` deep (the root if none). Reads only."""
    while True:
        if nodes[node, DEP] < max_depth:
            c = child(nodes, t0, t1, shift, half, node, tok)
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
def append(nodes, t0, t1, shift, half, state, max_depth, node, buf, row, begin, end):
    """Append ``buf[row, begin:end]`` to the sequence whose longest-suffix
    node is ``node``; returns its new one. Counts every suffix of each new
    token's context (up to ``max_depth`` + 1 nodes a token); new nodes and
    hashed edges go to node's half, as its whole trie does. The caller has
    checked the room (``extend_into`` does) and the tokens."""
    h = 0 if node < half else 1
    table = t0 if h == 0 else t1
    n_nodes, n_hashed = state[h, 0], state[h, 1]
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
                    c = child(nodes, t0, t1, shift, half, n, tok)
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
                        key = ((np.int64(n) << TOKEN_BITS) | tok) + 1
                        s = _probe(table, shift, key)
                        table[s, 0] = key
                        table[s, 1] = c
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
    state[h, 0], state[h, 1] = n_nodes, n_hashed
    return node


@kernel
def _valid(state, half, node):
    """``node`` is -1 or a node in use (in either half)."""
    return node == -1 or 0 <= node < state[0, 0] or half <= node < state[1, 0]


@kernel
def _check_ranges(state, half, starts, buf, rows, begins, ends):
    """0, or why the input is bad (checked before anything changes)."""
    for i in range(starts.shape[0]):
        if not (0 <= rows[i] < buf.shape[0] and 0 <= begins[i] <= ends[i] <= buf.shape[1]):
            return BAD_INPUT
        for s in range(starts.shape[1]):
            if not _valid(state, half, starts[i, s]):
                return BAD_INPUT
        for j in range(begins[i], ends[i]):
            if buf[rows[i], j] < 0 or buf[rows[i], j] >= TOKEN_LIMIT:
                return BAD_TOKEN
    return 0


@kernel
def extend_into(nodes, t0, t1, shift, half, state, max_depth, starts, buf, rows, begins, ends,
                out):
    """Append ``buf[rows[i], begins[i]:ends[i]]`` to each sequence ``starts[i, s]``
    (-1: none), its new node into ``out[i, s]`` (``out`` may be ``starts``).
    Returns (error or 0, tokens per sequence, half lacking room or -1); on
    an error nothing changed."""
    err = _check_ranges(state, half, starts, buf, rows, begins, ends)
    if err:
        return err, 0, -1
    total = 0
    need0 = need1 = 0  # worst case: max_depth new nodes (and edges) a token
    for i in range(starts.shape[0]):
        total += ends[i] - begins[i]
        for s in range(starts.shape[1]):
            if starts[i, s] >= 0:
                if starts[i, s] < half:
                    need0 += (ends[i] - begins[i]) * max_depth
                else:
                    need1 += (ends[i] - begins[i]) * max_depth
    for h in range(2):
        need = need0 if h == 0 else need1
        if (state[h, 0] + need > (h + 1) * half
                or 2 * (state[h, 1] + need) > t0.shape[0]):
            return FULL, total, h
    m = starts.shape[0]
    for i in range(m):
        if i + 1 < m:  # the next row's first nodes load while this row appends
            for s in range(starts.shape[1]):
                if starts[i + 1, s] >= 0:
                    prefetch(nodes, starts[i + 1, s])
        for s in range(starts.shape[1]):
            if starts[i, s] >= 0:
                out[i, s] = append(nodes, t0, t1, shift, half, state, max_depth, starts[i, s],
                                   buf, rows[i], begins[i], ends[i])
            else:
                out[i, s] = starts[i, s]
    return 0, total, -1


@kernel
def extend(nodes, t0, t1, shift, half, state, max_depth, starts, buf, rows, begins, ends):
    """:func:`extend_into` into a new array: (new nodes, error or 0, tokens
    per sequence, half lacking room or -1)."""
    out = starts.copy()
    err, total, full = extend_into(nodes, t0, t1, shift, half, state, max_depth, starts, buf,
                                   rows, begins, ends, out)
    return out, err, total, full


@kernel
def _draft_row(nodes, t0, t1, shift, half, max_depth, a, b, weight_b, max_tokens,
               min_prob, min_match, prior, toks, probs):
    """Joint greedy walk from ``a`` (weight 1) and ``b``; the draft's length."""
    if weight_b <= 0:
        b = -1
    p = 1.0
    n = 0
    while n < max_tokens:
        from_b, prob, nxt = False, 0.0, np.int64(-1)
        ctx = _top(nodes, a, min_match) if a >= 0 else -1
        score = 0.0
        if ctx >= 0:
            nxt = np.int64(nodes[ctx, BEST])
            prob = nodes[nxt, CNT] / (nodes[ctx, TOT] + prior)
            score = prob * (1 + nodes[ctx, DEP])
        if b >= 0:  # B must score strictly higher
            ctx = _top(nodes, b, min_match)
            if ctx >= 0:
                c = np.int64(nodes[ctx, BEST])
                prob_b = nodes[c, CNT] / (nodes[ctx, TOT] + prior)
                if weight_b * prob_b * (1 + nodes[ctx, DEP]) > score:
                    from_b, prob, nxt = True, prob_b, c
        if nxt < 0:
            break
        p *= prob
        if p < min_prob:
            break
        tok = nodes[nxt, TOK]
        toks[n] = tok
        probs[n] = p
        n += 1
        if from_b:
            b = nxt
            a = advance(nodes, t0, t1, shift, half, max_depth, a, tok) if a >= 0 else a
        else:
            a = nxt
            b = advance(nodes, t0, t1, shift, half, max_depth, b, tok) if b >= 0 else b
    return n


@kernel
def draft_into(nodes, t0, t1, shift, half, max_depth, start, max_tokens, weight_b, min_prob,
               min_match, prior, memo, tok, prob, lens):
    """Row i's joint greedy draft from nodes ``start[i]`` (A, B), at most
    ``max_tokens[i]`` tokens and ``tok``'s width, into ``tok[i]`` and
    ``prob[i]`` (0 past its length) and ``lens[i]``.

    Siblings at the same context draft the same walk: a row whose (A, B)
    an earlier row drafted from copies that draft, cut to its own limit,
    instead of walking it again (``memo``: scratch, a power of two >= 2m)."""
    m, k = tok.shape
    mask = memo.shape[0] - 1
    memo[:] = -1
    for i in range(m):
        if i + 1 < m:  # the next row's contexts load while this row drafts
            if start[i + 1, 0] >= 0:
                prefetch(nodes, start[i + 1, 0])
            if start[i + 1, 1] >= 0:
                prefetch(nodes, start[i + 1, 1])
        a, b = start[i, 0], start[i, 1]
        limit = max(min(max_tokens[i], k), 0)  # < 0 (no room left): no draft
        slot = ((a * 0x9E3779B1) ^ (b + 1)) & mask
        while memo[slot] >= 0 and not (start[memo[slot], 0] == a and start[memo[slot], 1] == b):
            slot = (slot + 1) & mask
        j = memo[slot]
        if j >= 0 and (limit <= max(min(max_tokens[j], k), 0) or lens[j] < min(max_tokens[j], k)):
            n = min(lens[j], limit)  # the same walk, stopped where it stopped or at limit
            for t in range(n):
                tok[i, t] = tok[j, t]
                prob[i, t] = prob[j, t]
        else:
            n = _draft_row(nodes, t0, t1, shift, half, max_depth, a, b, weight_b, limit, min_prob,
                           min_match, prior, tok[i], prob[i])
            memo[slot] = i
        for t in range(n, k):
            tok[i, t] = 0
            prob[i, t] = 0.0
        lens[i] = n


@kernel
def draft(nodes, t0, t1, shift, half, state, max_depth, nodes_a, nodes_b, weight_b,
          max_tokens, k, min_prob, min_match, prior):
    """:func:`draft_into` into new (rows, k) arrays, row i from nodes
    ``nodes_a[i]`` and ``nodes_b[i]``: (tokens, chances, lengths, error or 0)."""
    rows = nodes_a.shape[0]
    toks = np.zeros((rows, k), np.int32)
    probs = np.zeros((rows, k), np.float64)
    lens = np.zeros(rows, np.int32)
    for i in range(rows):
        if not (_valid(state, half, nodes_a[i]) and _valid(state, half, nodes_b[i])):
            return toks, probs, lens, BAD_INPUT
    start = np.empty((rows, 2), np.int64)
    start[:, 0] = nodes_a
    start[:, 1] = nodes_b
    size = 2
    while size < 2 * rows:
        size *= 2
    draft_into(nodes, t0, t1, shift, half, max_depth, start, max_tokens, weight_b, min_prob,
               min_match, prior, np.empty(size, np.int64), toks, probs, lens)
    return toks, probs, lens, 0


@kernel
def room(state, half, slots, young, rotate_at, old_full_at):
    """How full the arena's halves are, for the owner's rotation. Bit 1: a half is full enough to rotate (the young one past
    ``rotate_at``, or the old one past ``old_full_at``); bit 2: the young
    half is past half full. Fill: nodes or edges in use, whichever is the
    larger share."""
    code = 0
    for h in range(2):
        fill = max((state[h, 0] - h * half) / half, 2 * state[h, 1] / slots)
        if h == young:
            if fill > rotate_at:
                code |= 1
            if fill > 0.5:
                code |= 2
        elif fill > old_full_at:
            code |= 1
    return code


@kernel
def root_sizes(nodes, state, half, roots):
    """Nodes in each of the tries rooted at ``roots`` (a walk up the suffix
    links from every node: for tests and reports, not the hot path)."""
    index = np.full(2 * half, -1, np.int32)
    for r in range(roots.shape[0]):
        index[roots[r]] = r
    sizes = np.zeros(roots.shape[0], np.int64)
    for h in range(2):
        for i in range(h * half, state[h, 0]):
            n = i
            while nodes[n, DEP] > 0:
                n = nodes[n, LINK]
            if index[n] >= 0:
                sizes[index[n]] += 1
    return sizes
