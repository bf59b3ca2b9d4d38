"""Host side of the device route: consensus tries fed sibling tokens late,
and what a device copy of them needs each step.

The device drafts by looking up each row's current context in a table keyed
by context (see :mod:`consensus_spec.device_route.table`): one entry per trie
node, keyed by a hash of (its trie's root, its string), holding the node's
next-token statistics (total count, most frequent next token, its count).
The device walks the same joint greedy draft the host drafter walks, so the
table only has to mirror node statistics, and a step changes exactly the
nodes its appends touched.

:class:`LaggedTries` queues each step's tokens and appends them ``lag``
calls later, then reports the step's delta: keys of nodes new to the table,
nodes whose statistics changed (with their new values), and node ranges or
tries to drop (a rotated arena half, a restarted cross-group trie). Node
strings are never stored: appending a token touches the suffixes of the
path's text, whose last ``max_depth`` tokens each path keeps, so a compiled
replay of the append's walk names every touched node with its key.

Knows nothing of vLLM or of torch; reads :class:`SuffixForest`'s arrays.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from . import trie_kernels as TK
from .drafter import ConsensusDrafter, DrafterOptions
from .trie_kernels import BEST, CNT, DEP, LINK, TOK, TOT, advance, child  # noqa: F401  (bound compiled)
from ..jit import Kernels

kernel = Kernels(globals(), uses=(TK.kernel,))


def _signed(x: int) -> int:
    return int(np.uint64(x % (1 << 64)).astype(np.int64))


# Key of a context: H * KEY_A + (owner + 1) * KEY_B + length, wrapping int64,
# H = sum_i (t[-i] + 1) * HASH_P ** (i - 1) over its last tokens. The device
# computes the same numbers with torch int64 ops.
HASH_P = _signed(0x100000001B3)
KEY_A = _signed(0x9E3779B97F4A7C15)
KEY_B = _signed(0xC2B2AE3D27D4EB4F)


def hash_powers(max_depth: int) -> np.ndarray:
    out, x = [], 1
    for _ in range(max_depth + 1):
        out.append(_signed(x))
        x = (x * (HASH_P % (1 << 64))) % (1 << 64)
    return np.array(out, np.int64)


@kernel
def _walk(nodes, t0, t1, shift, half, max_depth, node, owner, text, begin, end, mark, stamp,
          powers, key_out, key_node, key_owner, dirty, values, n_keys, n_dirty):
    """Replay the appends of ``text[begin:end]`` from ``node`` of trie
    ``owner`` (after they were made; ``text[:begin]`` ends with ``node``'s
    string) and list, once a stamp, each node whose statistics they changed
    (``dirty``/``values``) and, of those, the ones not yet in the table
    (``mark == 0``: ``key_*``). Returns the new counts of both lists."""
    hp = np.zeros(max_depth + 2, np.int64)
    hn = np.zeros(max_depth + 2, np.int64)
    owner_term = (owner + 1) * KEY_B
    for p in range(begin, end):
        tok = text[p]
        # hp[d]: hash of text[p-d:p]; hn[d]: of text[p-d+1:p+1]
        hn[1] = tok + 1
        for d in range(1, max_depth + 1):
            if p - d >= 0:
                hp[d] = hp[d - 1] + (text[p - d] + 1) * powers[d - 1]
                if d + 1 <= max_depth:
                    hn[d + 1] = hn[d] + (text[p - d] + 1) * powers[d]
        n = node
        deepest = -1
        while True:
            d = nodes[n, DEP]
            if d < max_depth:
                c = child(nodes, t0, t1, shift, half, n, tok)
                for side in range(2):
                    m = np.int64(n) if side == 0 else np.int64(c)
                    dm = np.int64(d) + side
                    h = hp[d] if side == 0 else hn[d + 1]
                    if dm == 0 or mark[m] == stamp:
                        continue
                    if mark[m] == 0:
                        key_out[n_keys] = h * KEY_A + owner_term + dm
                        key_node[n_keys] = m
                        key_owner[n_keys] = owner
                        n_keys += 1
                    mark[m] = stamp
                    dirty[n_dirty] = m
                    b = nodes[m, BEST]
                    values[n_dirty, 0] = nodes[m, TOT]
                    values[n_dirty, 1] = nodes[b, TOK] if b >= 0 else -1
                    values[n_dirty, 2] = nodes[b, CNT] if b >= 0 else 0
                    n_dirty += 1
                if deepest < 0:
                    deepest = c
            if d == 0:
                break
            n = nodes[n, LINK]
        node = deepest
    return n_keys, n_dirty


@kernel
def _touched(nodes, t0, t1, shift, half, max_depth, paths, group_starts, group_owners, cross_starts,
             cross_owner, window, tokens, counts, mark, stamp, powers, key_out, key_node, key_owner,
             dirty, values, n_keys, n_dirty):
    """:func:`_walk` for each path's appends of ``tokens[i, :counts[i]]`` to
    its group trie and the cross-group trie (``cross_starts[i] < 0``: none),
    its text being its window (its last tokens) then those; the windows move on."""
    d = window.shape[1]
    text = np.empty(d + tokens.shape[1], np.int64)
    for i in range(paths.shape[0]):
        n = counts[i]
        if n == 0:
            continue
        text[:d] = window[paths[i]]
        text[d:d + n] = tokens[i, :n]
        if group_starts[i] >= 0:
            n_keys, n_dirty = _walk(nodes, t0, t1, shift, half, max_depth, group_starts[i],
                                    group_owners[i], text, d, d + n, mark, stamp, powers, key_out,
                                    key_node, key_owner, dirty, values, n_keys, n_dirty)
        if cross_starts[i] >= 0:
            n_keys, n_dirty = _walk(nodes, t0, t1, shift, half, max_depth, cross_starts[i],
                                    cross_owner, text, d, d + n, mark, stamp, powers, key_out,
                                    key_node, key_owner, dirty, values, n_keys, n_dirty)
        window[paths[i]] = text[n:n + d]
    return n_keys, n_dirty


@kernel
def table_contexts(nodes, t0, t1, shift, half, max_depth, min_match, buf, lens, group_roots,
                   cross_root):
    """The host's reading of the device table's lookup, per row: the (group
    trie node, cross-group trie node) pair whose joint walk
    (:func:`~.trie_kernels.draft_into`) is the draft the table's entry for
    the row's current context (``buf[i, :lens[i]]``'s last ``max_depth``
    tokens) holds; -1 where a source has no entry, (-1, -1) a miss. The
    group source wins when its longest hit is at least ``min_match`` deep;
    the cross-group one then looks up that context, else its own longest.
    :meth:`~consensus_spec.device_route.table.ContextTable.draft` walks the
    same thing in torch (tests/test_device_table.py holds the two equal)."""
    rows = lens.shape[0]
    a_out = np.full(rows, -1, np.int64)
    b_out = np.full(rows, -1, np.int64)
    for i in range(rows):
        n = lens[i]
        start = max(0, n - max_depth)
        a = group_roots[i]
        if a >= 0:
            for j in range(start, n):
                a = advance(nodes, t0, t1, shift, half, max_depth, a, buf[i, j])
            d = nodes[a, DEP]
            if d >= min_match:  # group table hit: key is the last d tokens
                b = cross_root
                if b >= 0:
                    for j in range(n - d, n):
                        b = advance(nodes, t0, t1, shift, half, max_depth, b, buf[i, j])
                a_out[i], b_out[i] = a, b
                continue
        if cross_root >= 0:  # shared cross-group table
            b = cross_root
            for j in range(start, n):
                b = advance(nodes, t0, t1, shift, half, max_depth, b, buf[i, j])
            if nodes[b, DEP] >= min_match:
                b_out[i] = b
    return a_out, b_out


@dataclass
class TableDelta:
    """One step's change to the device table, in the order to apply it."""

    drop_nodes: list            # [lo, hi) node-id ranges whose entries go (a rotated half)
    drop_owners: list           # tries whose entries go (a restarted cross-group trie)
    keys: np.ndarray            # int64 keys of new entries ...
    key_nodes: np.ndarray       # ... the node each names ...
    key_owners: np.ndarray      # ... and its trie
    nodes: np.ndarray           # nodes whose statistics are (re)written ...
    values: np.ndarray          # ... (n, 3) int32: total, best next token (-1: none), its count


class LaggedTries:
    """Consensus tries that see every path's tokens ``lag`` calls after they
    were written, and the device table's delta each call.

    Per call: :meth:`begin_call`; :meth:`add` new paths (prompt: not lagged),
    :meth:`leave` paths gone (released once their queued tokens are in),
    :meth:`push` this call's tokens; :meth:`advance` appends what is due;
    :meth:`roots` attaches the paths about to draft; :meth:`delta` is the
    table's change.
    A path's tokens pushed at call t are in the tries from call t + lag on,
    never before."""

    def __init__(self, lag: int, options: DrafterOptions | None = None):
        if lag < 0:
            raise ValueError("lag must be >= 0")
        self.lag = lag
        self.drafter = ConsensusDrafter(options or DrafterOptions())
        kernel.compile()
        o = self.drafter.options
        self.max_depth = o.max_depth
        self.powers = hash_powers(o.max_depth)
        self.calls = 0
        self.pending: deque = deque()   # (due call, paths, tokens (R, S), counts (R,))
        self.releases: deque = deque()  # (due call, path)
        self._window = np.full((0, o.max_depth), -1, np.int64)  # path -> its last tokens
        forest = self.drafter.forest
        self._mark = np.zeros(2 * forest.half, np.int32)  # node -> 0: not in the table; else last stamp
        self._keyed_roots: set[int] = set()  # group tries whose prompt tail is keyed
        self._tail_roots: list[int] = []     # group tries seen this call (maybe new)
        self._evictions = self.drafter.evictions
        self._cross = self.drafter.cross_root
        self.entries = 0          # table entries (keys) on the device
        self._cross_nodes: list[np.ndarray] = []  # nodes keyed for the current cross-group trie
        self._cross_count = 0
        self.cross_entries_max = 0  # the most the current cross-group trie ever had in the table
        self.cross_restarts = 0
        self.tokens_fed = 0
        self.late_feeds = 0       # due copies not yet visible at their call (fed later)

    # -- per call ----------------------------------------------------------

    def begin_call(self) -> None:
        self.calls += 1

    def add(self, prompt) -> int:
        """A new path continuing ``prompt``; returns its id."""
        d = self.drafter
        path = d.add_path(prompt)
        if path >= len(self._window):
            grown = np.full((max(64, 2 * len(self._window), path + 1), self.max_depth), -1, np.int64)
            grown[:len(self._window)] = self._window
            self._window = grown
        tail = np.asarray(prompt[-self.max_depth:], np.int64)
        self._window[path] = -1
        if len(tail):
            self._window[path, -len(tail):] = tail
        self._tail_roots.append(d.group_root(d.group_of(path)))
        return path

    def leave(self, path: int) -> None:
        self.releases.append((self.calls + self.lag, path))

    def push(self, paths: np.ndarray, tokens: np.ndarray, counts: np.ndarray, ready=None) -> None:
        """Tokens ``tokens[i, :counts[i]]`` written by ``paths[i]`` this call.
        ``ready()``, if given, says whether the arrays can be read yet (a
        device-to-host copy in flight); it is asked when they fall due."""
        self.pending.append((self.calls + self.lag, np.asarray(paths, np.int64), tokens, counts,
                             ready))  # not read before ready(): a copy may be in flight

    def advance(self, wait=None) -> list:
        """Append what is due and release the paths due; returns what was
        fed, for :meth:`delta`.
        A due copy not yet ready is left for a later call (``wait``: a
        callable that blocks until ready, used only at lag 0)."""
        fed = []
        while self.pending and self.pending[0][0] <= self.calls:
            due, paths, tokens, counts, ready = self.pending[0]
            if ready is not None and not ready():
                if self.lag == 0 and wait is not None:
                    wait()
                else:
                    self.late_feeds += 1
                    break
            self.pending.popleft()
            fed.append(self._feed(paths, tokens, counts))
        while self.releases and self.releases[0][0] <= self.calls and not (
                self.pending and self.pending[0][0] <= self.releases[0][0]):
            self.drafter.release(self.releases.popleft()[1])
        return fed

    @property
    def cross_entries(self) -> int:
        """Table entries of the current cross-group trie (the shared part)."""
        return self._cross_count

    def roots(self, paths) -> np.ndarray:
        """Each path's group trie (its root id: the table's owner key),
        (re)built if evicted, as the drafter would draft from it."""
        roots = self.drafter.group_roots(paths)
        self._tail_roots.extend(roots.tolist())
        return roots

    def _feed(self, paths, tokens, counts):
        d = self.drafter
        before = d.cursors(paths)
        roots_before = d.group_roots(paths, attach=False)
        cross_before, evictions = d.cross_root, d.evictions
        counts = np.asarray(counts, np.int64)[:len(paths)]
        d.extend_from(paths, tokens, np.arange(len(paths)), np.zeros(len(paths), np.int64), counts)
        self.tokens_fed += int(counts.sum())
        if d.evictions != evictions:  # cursors into the reset half are stale: count them unset
            young = d.forest.young
            before[d.forest.half_of(np.maximum(before, 0)) == young] = -1
            cross_before = -1
        return paths, tokens, counts, before, roots_before, cross_before

    def delta(self, fed) -> TableDelta:
        """The table's change since the last call (after :meth:`advance`
        and :meth:`roots`)."""
        d = self.drafter
        forest = d.forest
        drop_nodes, drop_owners = [], []
        if d.evictions != self._evictions:  # a half was dropped: its node ids are reused
            halves = [forest.young] if d.evictions == self._evictions + 1 else [0, 1]
            for h in halves:
                lo, hi = h * forest.half, (h + 1) * forest.half
                drop_nodes.append((lo, hi))
                self._mark[lo:hi] = 0
                self._keyed_roots = {r for r in self._keyed_roots if not lo <= r < hi}
        if d.evictions != self._evictions or d.cross_root != self._cross:
            if self._cross >= 0:  # the cross-group trie restarted (a rotation restarts it too)
                drop_owners.append(self._cross)
                self.cross_restarts += 1
                if self._cross_nodes:
                    old = np.concatenate(self._cross_nodes)
                    self._mark[old] = 0
                    self.entries -= len(old)
            self._cross_nodes, self._cross_count = [], 0
            self._cross = d.cross_root
        if d.evictions != self._evictions:
            self._evictions = d.evictions
            self.entries = int(np.count_nonzero(self._mark))
        tails = []
        cross = d.cross_root
        fed_roots = []
        for paths, tokens, counts, before, roots_before, cross_before in fed:
            roots_after = d.group_roots(paths, attach=False)
            fed_roots.append(roots_after)
            group_starts = np.where((roots_after == roots_before) & (before[:, 0] >= 0),
                                    before[:, 0], roots_after)
            cross_starts = (np.where(before[:, 1] >= 0, before[:, 1], cross) if cross == cross_before
                            else np.full(len(paths), cross, np.int64))
            tails.append((paths, group_starts, roots_after, cross_starts, tokens, counts))
        roots = [r for r in dict.fromkeys(self._tail_roots + [r for a in fed_roots for r in a.tolist()])
                 if r >= 0 and r not in self._keyed_roots]
        self._tail_roots = []
        return self._run(tails, roots, cross, drop_nodes, drop_owners)

    def _run(self, fed, roots, cross, drop_nodes, drop_owners) -> TableDelta:
        """The kernels over this call's appends and new group tries' prompt tails."""
        d, forest = self.drafter, self.drafter.forest
        tails = [d.prompt_tail(r) for r in roots]
        total = sum(int(c.sum()) for *_, c in fed) + sum(len(t) for t in tails if t is not None)
        cap = total * 4 * (self.max_depth + 1) + 1
        keys, key_nodes, key_owners, dirty = (np.empty(cap, np.int64) for _ in range(4))
        values = np.empty((cap, 3), np.int32)
        n_keys = n_dirty = 0
        args = (*forest.arena(), self.max_depth)
        outs = (self._mark, self.calls, self.powers, keys, key_nodes, key_owners, dirty, values)
        for paths, group_starts, owners, cross_starts, tokens, counts in fed:
            n_keys, n_dirty = _touched(*args, paths, group_starts, owners, cross_starts, cross,
                                       self._window, tokens, counts, *outs, n_keys, n_dirty)
        for root, tail in zip(roots, tails):
            if tail is None:
                continue
            self._keyed_roots.add(root)
            tail = tail.astype(np.int64)
            n_keys, n_dirty = _walk(*args, root, root, tail, 0, len(tail), *outs, n_keys, n_dirty)
        self.entries += n_keys
        cross_keys = key_owners[:n_keys] == self._cross
        if cross_keys.any():
            self._cross_nodes.append(key_nodes[:n_keys][cross_keys])
            self._cross_count += len(self._cross_nodes[-1])
            self.cross_entries_max = max(self.cross_entries_max, self.cross_entries)
        return TableDelta(drop_nodes, drop_owners, keys[:n_keys], key_nodes[:n_keys],
                          key_owners[:n_keys], dirty[:n_dirty], values[:n_dirty])
