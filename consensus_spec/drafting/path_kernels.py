"""Compiled calls of the drafter's path registry (:mod:`.paths`) and its
step: paths and sibling groups as arrays, registered, attached and
released with no Python object per path or group, one call for all the
paths a step starts, and one for the step's appends and drafts
(:func:`extend_and_draft`).

Paths: row p of the drafter's cursor array, and ``path_group[p]`` (-1: a
free id); free ids are a stack (``pfree``), lowest id on top after growth.

Groups: rows of ``groups`` (G, 9) int64, columns below. A group is
*remembered* while its prompt is in the LRU of ``max_group_tokens``
(``gtable``: a :mod:`~consensus_spec.keymap` from (prompt length, prompt
hash) to the group, so a path of a remembered prompt joins it), then
*forgotten*: it lives on while it has live paths or its trie is in the
arena, and its row is freed after. Prompts are known by their length and
:func:`~consensus_spec.keymap.seq_hash` (a collision, about 2**-64 a pair,
would put two prompts' paths in one group: they would draft from each
other, nothing worse); a caller that hashed them already passes the hashes.

``reg`` holds the scalars (free paths, free groups, group tokens,
remembered groups, live groups, the LRU's ends, the cross-group trie's
start in appended tokens).
"""

from __future__ import annotations

import numpy as np

from .. import keymap
from ..jit import Kernels
from ..keymap import EMPTY, find, insert, lru_append, lru_unlink, remove, seq_hash  # noqa: F401  (bound compiled)
from . import trie_kernels as TK
from .trie_kernels import UNSET, append, draft_into, extend_into, room  # noqa: F401  (bound compiled)

ROOT, START, LIVE, PLEN, SIZE, PREV, NEXT, STATE, HASH = range(9)  # group columns
FREE_ROW, REMEMBERED, FORGOTTEN = 0, 1, 2  # STATE
FREE_PATHS, FREE_GROUPS, GROUP_TOKENS, NUM_REMEMBERED, LIVE_GROUPS, OLDEST, NEWEST, \
    CROSS_SINCE = range(8)  # reg
# add_paths' events: what Python must do before it goes on
DONE, GROW_PATHS, GROW_GROUPS, ROTATE, NEW_CROSS, ROOT_FULL, BUILD_FULL, BAD_TOKEN, BAD_ROW = range(9)

kernel = Kernels(globals(), uses=(keymap.kernel, TK.kernel))


@kernel
def tail_length(prompt_tokens, length):
    """Tokens of a ``length``-token prompt a group's trie indexes: the last
    ``prompt_tokens``, as ``prompt[length - prompt_tokens:]`` cuts them.
    For a prompt shorter than ``prompt_tokens`` that slice starts from
    the end (a negative index): the whole prompt only when it is at most
    half ``prompt_tokens``, else its last ``prompt_tokens - length``
    tokens. Kept as the drafter has always cut it (drafts stay the same);
    docs/host_time.md ("Prompt tails") says what indexing whole prompts
    would change."""
    if prompt_tokens == 0:
        return 0
    if prompt_tokens <= length:
        return prompt_tokens
    return min(length, prompt_tokens - length)


@kernel
def _unlink(groups, reg, g):
    lru_unlink(groups[:, PREV], groups[:, NEXT], reg[OLDEST:NEWEST + 1], g)


@kernel
def _append_lru(groups, reg, g):
    lru_append(groups[:, PREV], groups[:, NEXT], reg[OLDEST:NEWEST + 1], g)


@kernel
def _free_if_dead(groups, reg, gfree, g):
    """Free a forgotten group's row once nothing refers to it."""
    if groups[g, STATE] == FORGOTTEN and groups[g, LIVE] == 0 and groups[g, ROOT] < 0:
        groups[g, STATE] = FREE_ROW
        gfree[reg[FREE_GROUPS]] = g
        reg[FREE_GROUPS] += 1


@kernel
def _use(groups, reg, gfree, g, paths):
    live = groups[g, LIVE]
    reg[LIVE_GROUPS] += np.int64(live + paths > 0) - np.int64(live > 0)
    groups[g, LIVE] = live + paths
    _free_if_dead(groups, reg, gfree, g)


@kernel
def build(nodes, t0, t1, shift, half, state, max_depth, young, tokens, row, begin, end):
    """A new trie in the young half holding ``tokens[row, begin:end]``:
    (root, its node after them, event). ``ROOT_FULL``: no room for the
    root (nothing changed); ``BUILD_FULL``: the root went in but the
    tokens would not fit (it stays, as garbage, until its half is dropped)."""
    h = young
    r = state[h, 0]
    if r + 1 > (h + 1) * half:
        return -1, -1, ROOT_FULL
    nodes[r, 0], nodes[r, 1], nodes[r, 2], nodes[r, 3] = -1, 0, 0, 0
    nodes[r, 4], nodes[r, 5], nodes[r, 6] = -1, r, -1
    state[h, 0] += 1
    need = (end - begin) * max_depth
    if state[h, 0] + need > (h + 1) * half or 2 * (state[h, 1] + need) > t0.shape[0]:
        return r, -1, BUILD_FULL
    node = append(nodes, t0, t1, shift, half, state, max_depth, r, tokens, row, begin, end)
    return r, node, DONE


@kernel
def add_paths(buf, rows, ends, hashes, out, i, phase, made, n_made, path_group, pfree, cursor,
              groups, gtable, gfree, reg, nodes, t0, t1, shift, half, state, meta, max_depth, young,
              slots, cross_start, prompt_tokens, max_group_tokens, cross_group_tokens, rotate_at,
              old_full_at, token_limit):
    """A new path per row ``rows[j]`` (prompt ``buf[rows[j], :ends[j]]``,
    its :func:`seq_hash` ``hashes[j]``, or computed here if ``hashes`` is
    empty) into ``out[j]``, from j = ``i`` on, as :meth:`ConsensusDrafter.add_path`
    adds one: its group (found, or new and remembered), a free id, the
    arena's room check, the group's trie if it has none, its cursor after
    the prompt tail. Stops where Python must act (an event) and goes on
    from (``i``, ``phase``). New groups go to ``made[:, n_made:]`` (group,
    j). Returns (i, phase, event, n_made)."""
    while i < rows.shape[0]:
        row, end = rows[i], ends[i]
        if phase == 0:
            if not (0 <= row < buf.shape[0] and 0 <= end <= buf.shape[1]):
                return i, phase, BAD_ROW, n_made
            if reg[FREE_PATHS] == 0:
                return i, phase, GROW_PATHS, n_made
            if reg[FREE_GROUPS] == 0 or 2 * (groups.shape[0] - reg[FREE_GROUPS] + 1) > gtable.shape[0]:
                return i, phase, GROW_GROUPS, n_made
            n = tail_length(prompt_tokens, end)
            for t in range(end - n, end):
                if buf[row, t] < 0 or buf[row, t] >= token_limit:
                    return i, phase, BAD_TOKEN, n_made
            h = np.int64(hashes[i] if hashes.shape[0] else seq_hash(EMPTY, buf, row, 0, end))
            g = find(gtable, groups[:, PLEN], groups[:, HASH], end, h)
            if g < 0:
                reg[FREE_GROUPS] -= 1
                g = gfree[reg[FREE_GROUPS]]
                groups[g, ROOT], groups[g, START], groups[g, LIVE] = -1, -1, 0
                groups[g, PLEN], groups[g, SIZE], groups[g, HASH] = end, end + n, h
                groups[g, STATE] = REMEMBERED
                insert(gtable, groups[:, PLEN], groups[:, HASH], g)
                made[0, n_made], made[1, n_made] = g, i
                n_made += 1
                _append_lru(groups, reg, g)
                reg[NUM_REMEMBERED] += 1
                reg[GROUP_TOKENS] += groups[g, SIZE]
                while reg[GROUP_TOKENS] > max_group_tokens and reg[NUM_REMEMBERED] > 1:
                    old = reg[OLDEST]  # its trie is garbage once its paths finish
                    _unlink(groups, reg, old)
                    remove(gtable, groups[:, PLEN], groups[:, HASH], old)
                    groups[old, STATE] = FORGOTTEN
                    reg[NUM_REMEMBERED] -= 1
                    reg[GROUP_TOKENS] -= groups[old, SIZE]
                    _free_if_dead(groups, reg, gfree, old)
            else:
                _unlink(groups, reg, g)
                _append_lru(groups, reg, g)
            reg[FREE_PATHS] -= 1
            p = pfree[reg[FREE_PATHS]]
            path_group[p] = g
            _use(groups, reg, gfree, g, 1)
            out[i] = p
            phase = 1
        if phase == 1:  # once a step is enough: the extend call does it (no tidying)
            phase = 2
            if room(state, half, slots, young, rotate_at, old_full_at) & 1:
                return i, phase, ROTATE, n_made
            if meta[0] - reg[CROSS_SINCE] > cross_group_tokens:
                return i, phase, NEW_CROSS, n_made
        p = out[i]
        g = path_group[p]
        if groups[g, ROOT] < 0:
            n = groups[g, SIZE] - groups[g, PLEN]
            r, node, event = build(nodes, t0, t1, shift, half, state, max_depth, young, buf, row,
                                   end - n, end)
            if event != DONE:
                return i, phase, event, n_made
            meta[0] += n
            groups[g, ROOT], groups[g, START] = r, node
        # a new path really continues the prompt: it starts after the prompt tail
        cursor[p, 0] = groups[g, START]
        cursor[p, 1] = cross_start
        i += 1
        phase = 0
    return i, phase, DONE, n_made


@kernel
def release_paths(ids, path_group, cursor, pfree, groups, reg, gfree):
    """Free each path of ``ids``; -1, or the index of the first that is
    not a live path (nothing is changed then)."""
    for j in range(ids.shape[0]):
        p = ids[j]
        if not 0 <= p < path_group.shape[0] or path_group[p] < 0:
            return j
        for k in range(j):
            if ids[k] == p:
                return j
    for j in range(ids.shape[0]):
        p = ids[j]
        _use(groups, reg, gfree, path_group[p], -1)
        path_group[p] = -1
        cursor[p, 0] = UNSET
        cursor[p, 1] = UNSET
        pfree[reg[FREE_PATHS]] = p
        reg[FREE_PATHS] += 1
    return -1


@kernel
def drop_tries(groups, reg, gfree, lo, hi):
    """Groups whose tries are rooted in nodes [lo, hi) lose them (their
    rows freed if nothing else holds them). Returns (tries dropped, of
    those with live paths)."""
    dropped = live = 0
    for g in range(groups.shape[0]):
        if groups[g, STATE] != FREE_ROW and lo <= groups[g, ROOT] < hi:
            groups[g, ROOT] = groups[g, START] = -1
            dropped += 1
            live += groups[g, LIVE] > 0
            _free_if_dead(groups, reg, gfree, g)
    return dropped, live


# extend_and_draft's errors beside the trie kernels' (TK.BAD_TOKEN ...): what Python must do
ROOM, UNATTACHED, SMALL, FULL = -6, TK.STALE, TK.SMALL, TK.FULL


@kernel
def extend_and_draft(nodes, t0, t1, shift, half, state, meta, max_depth, young, slots, cursor,
                     path_group, groups, reg, ids, buf, rows, begins, ends, max_tokens, weight_b,
                     min_prob, min_match, prior, cross_start, check_room, rotate_at, old_full_at,
                     cross_group_tokens, starts, memo, toks, probs, lens):
    """The drafter's step, one call: path ``ids[i]`` takes
    ``buf[rows[i], begins[i]:ends[i]]`` (every path before any drafts),
    then drafts (:func:`draft_into`) at most ``max_tokens[i]``; k, the
    width, is the largest. Paths whose cursors a rotation or a restarted
    cross-group trie unset are attached (at their group trie's root, or
    the cross-group trie's), as :meth:`ConsensusDrafter._attach` would.
    ``toks`` and ``probs`` are flat (row i at ``i * k``), ``lens`` per row;
    ``starts`` and ``memo`` are scratch: nothing is allocated.

    Returns (0 or an error, k). Errors, nothing appended: ``ROOM`` (with
    ``check_room``: the arena must rotate or the cross-group trie restart
    first), ``UNATTACHED`` (a path's group has no trie: build it first),
    ``SMALL`` (the buffers cannot hold m x k), ``FULL`` (a half lacks the
    room), ``TK.BAD_INPUT`` / ``TK.BAD_TOKEN``."""
    m = ids.shape[0]
    k = 0
    for i in range(m):
        k = max(k, max_tokens[i])
    if m * k > toks.shape[0] or m > lens.shape[0] or m > starts.shape[0] or 2 * m > memo.shape[0]:
        return SMALL, k
    for i in range(m):
        if not 0 <= ids[i] < cursor.shape[0] or path_group[ids[i]] < 0:
            return TK.BAD_INPUT, k
    if check_room and (room(state, half, slots, young, rotate_at, old_full_at) & 1
                       or meta[0] - reg[CROSS_SINCE] > cross_group_tokens):
        return ROOM, k
    for i in range(m):
        p = ids[i]
        if cursor[p, 0] == UNSET and groups[path_group[p], ROOT] < 0:
            return UNATTACHED, k
    start = starts[:m]
    for i in range(m):
        p = ids[i]
        if cursor[p, 0] == UNSET:
            cursor[p, 0] = groups[path_group[p], ROOT]
        if cursor[p, 1] == UNSET:
            cursor[p, 1] = cross_start
        start[i, 0] = cursor[p, 0]
        start[i, 1] = cursor[p, 1]
    err, total, _ = extend_into(nodes, t0, t1, shift, half, state, max_depth, start, buf, rows,
                                begins, ends, start)
    if err:
        return err, k
    meta[0] += total
    for i in range(m):
        cursor[ids[i], 0] = start[i, 0]
        cursor[ids[i], 1] = start[i, 1]
    draft_into(nodes, t0, t1, shift, half, max_depth, start, max_tokens, weight_b, min_prob,
               min_match, prior, memo, toks[:m * k].reshape((m, k)), probs[:m * k].reshape((m, k)),
               lens[:m])
    return 0, k
