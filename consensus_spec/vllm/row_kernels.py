"""Compiled matching of :class:`~consensus_spec.vllm.rows.RowTracker`: which
path is in which batch row, found from token content alone. Python calls
these kernels through this module's attributes, which :meth:`Kernels.compile`
swaps for their compiled versions.

vLLM's proposer interface passes no request ids: rows are condensed when
requests finish, reused, preempted and resumed, prefills arrive in chunks,
and whole steps go by without a propose call (vLLM skips the drafter while
any row is within ``k`` tokens of ``max_model_len``). A path is known by a
64-bit hash of its whole token sequence, kept per row and extended by each
step's new tokens, so paths of different prompts (or siblings that differ
anywhere) are not confused because their length and last tokens agree.

A path's hash is :func:`consensus_spec.keymap.seq_hash` of its tokens: a
new row's prompt hash is the key the drafter knows its group by.

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
the candidate had moved there. Rows that match no former path are left for
the tracker to resume or start (path -1).

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
One compiled call per step (``match``) matches every row, parks the
paths no row continues and resumes parked ones (:mod:`.parking`), into
buffers the tracker keeps; only new paths go back to Python (:mod:`.rows`),
one call per step for all of them.
"""

from __future__ import annotations

import numpy as np

from .. import keymap
from ..jit import Kernels
from ..keymap import EMPTY, mix, seq_hash  # noqa: F401  (bound compiled)
from . import parking as P
from .parking import park, unpark  # noqa: F401  (bound compiled)

TAIL = 4          # last tokens compared for an exact continuation
MAX_MISSED = 64   # tokens a parked path may have advanced during missed steps
IDLE, EXACT, OTHER = 0, 1, 2  # row states (rs[2]) from match: no new tokens, its path continued, other
_ZERO = EMPTY  # hash of no tokens

kernel = Kernels(globals(), uses=(P.kernel, keymap.kernel))


@kernel
def _extend(h, token_ids, i, begin, end):
    return seq_hash(h, token_ids, i, begin, end)


@kernel
def _prefixes(token_ids, i, end, out, last=-1, last_end=0):
    """out[n] = hash of row i's first n tokens, for n <= end. If ``out``
    holds row ``last``'s up to ``last_end`` (the row done before), the part
    the two rows share is kept, not hashed again: new siblings arrive in
    adjacent rows with one long prompt, and comparing tokens is several
    times cheaper than the hash's chain of multiplies."""
    n = 0
    if last >= 0:
        limit = min(end, last_end)
        while n < limit and token_ids[i, n] == token_ids[last, n]:
            n += 1
    else:
        out[0] = _ZERO
    h = out[n]
    for t in range(n, end):
        h = out[t + 1] = mix(h, token_ids[i, t])


@kernel
def _continues(token_ids, i, length, tail):
    """Row i's tokens before ``length`` are ``tail`` (index-clipped at 0)."""
    for t in range(TAIL):
        if token_ids[i, max(length - TAIL + t, 0)] != tail[t]:
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
def match(counts, ends, token_ids, token_limit, rs, hs, tails, window, flags, idx, scratch, out,
          contiguous, keys, parked, table, meta, key_free, max_parked, max_per_key, released):
    """Find each row's path (one call per step; nothing allocated).

    Per row: ``rs`` rows path (-1: none), length, state, and last step's
    path and length (scratch); ``hs`` rows hash and last step's hash;
    ``tails[0]`` its last tokens, ``tails[1]`` last step's. Rows with new
    tokens come out as ``out`` rows (row, path, begin, end) and
    ``contiguous``; former paths no row continues are parked
    (:mod:`.parking`, those its caps push out into ``released``); a row no
    former path fits resumes a parked path, else gets path -1 (a new path
    for the caller to start; then ``window[row, d]`` is the hash of its
    first ``begin - d`` tokens).

    Returns (rows out, released, rows moved, tokens missed, rows left with
    path -1 (their indices in ``out`` in ``idx[1]``), rows rejected, paths
    resumed, tokens the rows produced)."""
    path, lens, state, old_path, old_lens = rs[0], rs[1], rs[2], rs[3], rs[4]
    hashes, old_hash = hs[0], hs[1]
    tail, old_tail = tails[0], tails[1]
    free, demoted = flags[0], flags[1]
    num_rows, width, n = counts.shape[0], token_ids.shape[1], path.shape[0]
    old_path[:] = path
    old_lens[:] = lens
    old_tail[:] = tail
    old_hash[:] = hashes
    free[:] = False
    live = rejected = 0
    lagged = False  # steps were missed
    for i in range(n):
        if i >= num_rows:
            free[i] = old_path[i] >= 0
            path[i], lens[i] = -1, -1
        elif counts[i] == 0:
            state[i] = IDLE
        elif counts[i] < 0 or ends[i] > width or ends[i] < counts[i] or not _in_range(
                token_ids, i, ends[i] - counts[i], ends[i], token_limit):
            # garbage: this row alone sits the step out and starts clean
            state[i], counts[i] = IDLE, 0
            free[i] = old_path[i] >= 0
            path[i], lens[i] = -1, -1
            rejected += 1
        else:
            base = ends[i] - counts[i]
            if base == old_lens[i] and _continues(token_ids, i, base, old_tail[i]):
                state[i] = EXACT
            elif not _in_range(token_ids, i, 0, base, token_limit):  # all of it is read
                state[i], counts[i] = IDLE, 0
                free[i] = old_path[i] >= 0
                path[i], lens[i] = -1, -1
                rejected += 1
                continue
            else:
                state[i] = OTHER
                free[i] = old_path[i] >= 0
                if 0 < old_lens[i] < base and _continues(token_ids, i, old_lens[i], old_tail[i]):
                    lagged = True  # this row caught up, so moved paths may have advanced too
            live += 1
    cand = idx[0]  # scratch: indices of free former paths
    n_cand = _where(free, cand)
    pending = idx[1]
    n_pending = _where(free, pending)
    while n_pending:  # exact rows a free path may have moved into; O(length) each
        demoted[:] = False
        for i in range(num_rows):
            if state[i] == EXACT \
                    and _shadowed(token_ids, i, pending[:n_pending], old_lens, old_tail, old_hash,
                                  lagged) \
                    and _extend(_ZERO, token_ids, i, 0, old_lens[i]) != old_hash[i]:
                state[i] = OTHER
                free[i] = demoted[i] = old_path[i] >= 0
        n_pending = _where(demoted, pending)  # its path is free now: check the others against it
        n_cand = _where(free, cand)
    m = moved = missed = 0
    hashed, hashed_end = -1, 0  # the row whose prefix hashes scratch holds
    for i in range(num_rows):
        if state[i] == IDLE:
            continue
        end = ends[i]
        base = end - counts[i]
        begin, who = base, -1
        if state[i] == EXACT:
            who = i
            hashes[i] = _extend(old_hash[i], token_ids, i, base, end)
        else:  # caught up in its own row after missed steps, else moved here
            _prefixes(token_ids, i, end, scratch, hashed, hashed_end)
            hashed, hashed_end = i, end
            hashes[i] = scratch[end]
            n = old_lens[i]
            if free[i] and 0 < n <= base and scratch[n] == old_hash[i]:
                who = i
            else:
                for c in range(n_cand):
                    r = cand[c]
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
                for d in range(min(MAX_MISSED, base) + 1):
                    window[i, d] = scratch[base - d]
        path[i] = old_path[who] if who >= 0 else -1
        lens[i] = end
        for t in range(TAIL):
            tail[i, t] = token_ids[i, max(end - TAIL + t, 0)]
        out[0, m], out[1, m], out[2, m], out[3, m] = i, path[i], begin, end
        contiguous[m] = state[i] == EXACT
        m += 1
    n_released = 0
    for c in range(n_cand):  # former paths no row took, in row order
        r = cand[c]
        if free[r]:
            n_released = park(keys, parked, table, meta, key_free, max_parked, max_per_key,
                              old_path[r], old_lens[r], np.int64(old_hash[r]), released,
                              n_released)
    unresolved = resumed = 0
    for j in range(m):
        if out[1, j] >= 0:
            continue
        i, base = out[0, j], out[2, j]
        found, length = unpark(keys, parked, table, meta, key_free, window, i, base, MAX_MISSED)
        if found < 0:  # a new path, for the caller to start
            pending[unresolved] = j
            unresolved += 1
            continue
        resumed += 1
        missed += base - length
        out[2, j] = length
        path[i] = out[1, j] = found
    tokens = 0
    for i in range(num_rows):
        tokens += counts[i]
    return m, n_released, moved, missed, unresolved, rejected, resumed, tokens


@kernel
def _where(mask, out):
    """Indices of ``mask``'s True entries into ``out``; their number."""
    n = 0
    for i in range(mask.shape[0]):
        if mask[i]:
            out[n] = i
            n += 1
    return n


@kernel
def accepted(rows, paths, sent, path, state, counts, accepted):
    """Tokens the verifier kept of each draft sent last step, into
    ``accepted``; 0 (and nothing sent) where the row no longer holds that
    path contiguously. Returns their sum and the sum of ``sent`` after."""
    kept = judged = 0
    for j in range(rows.shape[0]):
        i = rows[j]
        accepted[j] = 0
        if sent[j] > 0 and i < counts.shape[0] and state[i] == EXACT and path[i] == paths[j]:
            accepted[j] = min(counts[i] - 1, sent[j])
            kept += accepted[j]
            judged += sent[j]
        else:
            sent[j] = 0
    return kept, judged


@kernel
def pack(rows, tokens, lengths, num_rows, flat, offsets):
    """The drafts in batch-row order, for vLLM's lists: row ``rows[j]``
    (increasing) drafts ``tokens[j, :lengths[j]]``, every other row nothing;
    row i's are ``flat[offsets[i]:offsets[i + 1]]``. Returns their number."""
    n = j = 0
    for i in range(num_rows):
        offsets[i] = n
        if j < rows.shape[0] and rows[j] == i:
            for t in range(lengths[j]):
                flat[n] = tokens[j, t]
                n += 1
            j += 1
    offsets[num_rows] = n
    return n


@kernel
def room(ends, limit, k, out):
    """``out[i] = min(limit - ends[i], k)``: how many draft tokens row i may
    get (< 0: none), as ``np.minimum(limit - ends, k)`` would give it."""
    for i in range(ends.shape[0]):
        out[i] = min(limit - ends[i], k)
