"""Sibling-consensus drafting over suffix tries, independent of any engine.

Paths that continue the same prompt form a sibling group sharing one trie
over the prompt (its tail) and every sibling's output, so a path drafts what
its siblings wrote after the same context, and its own prompt and history
when they offer nothing better. A second, cross-group trie over all recent
outputs is the other source, weighted below siblings.

All tries live in one compiled arena (:class:`SuffixForest`) so a step's
appends, and its drafts, are one call each for the whole batch. Memory stays
bounded however many paths pass: released path ids are reused, groups are
forgotten least recently used, the cross-group trie restarts beyond a token
budget, and once the arena holds ``max_trie_nodes`` nodes tries are evicted
(see :meth:`ConsensusDrafter._evict`): forgotten ones first, then idle
groups least recently used, then the cross-group trie, live groups last.

The bound on each structure:

- per-path arrays (group, cursors): the most paths live at once, rounded up
  to a power of two. Released ids are reused, so this is the caller's
  bound: a path never released keeps its slot and its group live (the
  proposer's row tracker holds at most the batch plus ``max_parked``);
- remembered groups: ``max_group_tokens`` prompt tokens (LRU); a forgotten
  group lives on while it has live paths or its trie is in the arena;
- the arena: about ``max_trie_nodes`` nodes (evicting down to ``EVICT_TO``
  of it; the node array keeps its capacity, the edge table shrinks with
  its edges), and a trie per group or cross-group trie it holds.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain
from dataclasses import dataclass, fields

import numpy as np

from .forest import UNSET, SuffixForest


@dataclass(frozen=True)
class DrafterOptions:
    max_depth: int = 8              # longest context (tokens) matched in a trie
    min_prob: float = 0.05          # stop once P(this draft token accepted) < min_prob
    min_match: int = 1              # shortest context a draft may come from
    prior: float = 0.5              # pseudo-count added to node totals: few sightings weigh less
    cross_group_weight: float = 0.8  # other prompts' outputs count this much of siblings'
    prompt_tokens: int = 512        # prompt tail indexed per group
    max_group_tokens: int = 400_000  # prompt tokens of remembered groups (LRU)
    cross_group_tokens: int = 600_000  # the cross-group trie restarts beyond this
    max_trie_nodes: int = 8_000_000  # arena size (~40 B a node) at which least-recently-used
    #                                  groups are evicted (down to 3/4 of it)

    def __post_init__(self):
        if self.max_depth < 1 or self.min_match < 1 or self.min_match > self.max_depth:
            raise ValueError("need 1 <= min_match <= max_depth")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError("min_prob must be in [0, 1]")
        if self.prior < 0 or not 0.0 <= self.cross_group_weight <= 1.0:
            raise ValueError("prior must be >= 0 and cross_group_weight in [0, 1]")
        if min(self.prompt_tokens, self.max_group_tokens, self.cross_group_tokens) < 0:
            raise ValueError("token budgets must be >= 0")
        if self.max_trie_nodes < 1000:
            raise ValueError("max_trie_nodes must be >= 1000")

    @classmethod
    def from_dict(cls, options: dict) -> "DrafterOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown drafter option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)


# An eviction leaves at most this fraction of max_trie_nodes. Each costs a pass
# over the arena (~0.1-0.3 s at 8M nodes), so freeing a quarter spreads it
# over ~2M nodes of appends (~400k tokens) while keeping most of the history.
EVICT_TO = 0.75


class Group:
    __slots__ = ("prompt_tail", "size", "root", "start", "live", "used", "remembered")

    def __init__(self, prompt_tail: list[int], size: int):
        self.prompt_tail = prompt_tail
        self.size = size  # prompt tokens it holds (key and tail), for the LRU budget
        self.root = self.start = -1  # its trie's root and prompt-tail node; -1: no trie
        self.live = 0  # paths added and not released
        self.used = 0  # drafter clock at its last add_path or release
        self.remembered = True  # still found by its prompt (not forgotten by the LRU)


def prompt_key(prompt) -> bytes:
    return np.asarray(prompt, dtype=np.int64).tobytes()


class ConsensusDrafter:
    """Paths are integer ids; their trie positions are rows of one cursor
    array, so a step touches no per-path Python object. A cursor is
    ``UNSET`` until the path is attached to the current tries, and again
    after the trie it points into is evicted or restarted."""

    def __init__(self, options: DrafterOptions | None = None):
        self.options = options or DrafterOptions()
        self._groups: OrderedDict[bytes, Group] = OrderedDict()
        self._group_tokens = 0
        self._path_group: list[Group | None] = []
        self._free: list[int] = []
        self._cursor = np.zeros((0, 2), np.int64)  # path -> (node in group trie, in cross trie)
        self._clock = 0  # counts add_path and release calls, for LRU order
        self._live_groups = 0  # groups with unreleased paths
        limit = self.options.max_trie_nodes
        self.forest = SuffixForest(self.options.max_depth, min(1 << 16, limit), soft_capacity=limit)
        self._owners: dict[int, Group | None] = {}  # root -> its group (None: a cross-group trie)
        self._new_cross()
        self.forest.root_sizes([self._cross_root])  # compile the eviction kernels now,
        self.forest.compact([self._cross_root])     # not at the first eviction, hours in
        self.evictions = 0       # compactions run
        self.groups_evicted = 0  # group tries dropped (forgotten ones included)
        self.live_groups_evicted = 0  # of those, groups with unreleased paths
        self.nodes_evicted = 0

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    @property
    def num_paths(self) -> int:
        """Paths added and not released."""
        return len(self._path_group) - len(self._free)

    @property
    def num_live_groups(self) -> int:
        """Groups with paths added and not released (remembered or not)."""
        return self._live_groups

    @property
    def path_slots(self) -> int:
        """Rows of the per-path arrays: the most paths ever live at once,
        rounded up to a power of two, at least 64 (released ids are reused)."""
        return len(self._path_group)

    @property
    def num_tries(self) -> int:
        """Tries in the arena: groups' (until evicted) and cross-group ones
        (a restarted one stays, as garbage, until the next eviction)."""
        return len(self._owners)

    @property
    def arena_bytes(self) -> int:
        """Bytes of the forest's arrays (nodes, their roots, the edge table)."""
        return self.forest.nbytes

    def num_nodes(self) -> int:
        """Trie nodes held, for memory checks."""
        return self.forest.num_nodes()

    def add_path(self, prompt) -> int:
        """Register a new path continuing ``prompt`` (token ids); returns its id."""
        key = prompt_key(prompt)
        group = self._groups.get(key)
        if group is None:
            n = self.options.prompt_tokens
            tail = np.asarray(prompt[len(prompt) - n:] if n else prompt[:0]).tolist()
            group = Group(tail, len(prompt) + len(tail))
            self._groups[key] = group
            self._group_tokens += group.size
            while self._group_tokens > self.options.max_group_tokens and len(self._groups) > 1:
                _, old = self._groups.popitem(last=False)
                self._group_tokens -= old.size
                old.remembered = False  # its trie is garbage once its paths finish
        else:
            self._groups.move_to_end(key)
        if not self._free:
            self._grow()
        path = self._free.pop()
        self._path_group[path] = group
        self._use(group, +1)
        self._build(group)
        # a new path really continues the prompt: it starts after the prompt tail
        self._cursor[path] = group.start, self._cross_start()
        return path

    def release(self, path: int) -> None:
        """Forget a finished path; its id may be reused."""
        if not 0 <= path < len(self._path_group) or self._path_group[path] is None:
            raise ValueError(f"no such path: {path}")
        self._use(self._path_group[path], -1)
        self._path_group[path] = None
        self._cursor[path] = UNSET
        self._free.append(path)

    def _use(self, group: Group, paths: int) -> None:
        self._clock += 1
        group.used = self._clock
        self._live_groups += (group.live + paths > 0) - (group.live > 0)
        group.live += paths

    def extend(self, paths, tokens: list[list[int]]) -> None:
        """Record the output tokens each path generated (one call per step)."""
        counts = np.fromiter(map(len, tokens), np.int64, len(tokens))
        flat = np.fromiter(chain.from_iterable(tokens), np.int64, int(counts.sum()))
        ends = np.cumsum(counts)
        self.extend_from(paths, flat.reshape(1, -1), np.zeros(len(counts), np.int64),
                         ends - counts, ends)

    def extend_from(self, paths, buffer, rows, begins, ends) -> None:
        """Like :meth:`extend`, path ``paths[i]`` taking
        ``buffer[rows[i], begins[i]:ends[i]]`` from a 2-D token array."""
        self._make_room()
        paths = self._attached(paths)
        self._cursor[paths] = self.forest.extend_rows(self._cursor[paths], buffer, rows, begins, ends)

    def draft(self, paths, max_tokens):
        """Most likely continuation of each path, at most ``max_tokens[i]``
        long, and the estimated chance that each prefix is accepted.

        Returns ``(tokens, probs, lengths)``: (R, k) arrays, row i valid up to
        ``lengths[i]``. Each token comes from whichever source (siblings, or
        all recent outputs at ``cross_group_weight``) scores higher on
        ``weight * P(token | context) * (1 + context length)``; a draft ends
        once the running product of the chosen probabilities drops below
        ``min_prob`` (see :func:`tests.reference_trie.joint_draft`).
        """
        o = self.options
        paths = self._attached(paths)
        max_tokens = np.asarray(max_tokens, np.int32).reshape(len(paths))
        k = int(max_tokens.max(initial=0))
        cursor = self._cursor[paths]
        return self.forest.draft_many(cursor[:, 0], cursor[:, 1], o.cross_group_weight,
                                      max_tokens, k, o.min_prob, o.min_match, o.prior)

    def extend_and_draft(self, paths, buffer, rows, begins, ends, max_tokens, min_prob=None):
        """:meth:`extend_from` then :meth:`draft`, in one compiled call;
        ``min_prob`` raises the options' one for this call."""
        o = self.options
        self._make_room()
        floor = o.min_prob if min_prob is None else max(o.min_prob, min_prob)
        args = (buffer, rows, begins, ends, max_tokens,
                o.cross_group_weight, floor, o.min_match, o.prior)
        out = self.forest.extend_and_draft(self._cursor, paths, *args)
        if out is None:  # some cursor is unset: attach, then go again
            out = self.forest.extend_and_draft(self._cursor, self._attached(paths), *args)
        return out

    def _make_room(self) -> None:
        """Evict tries, or restart the cross-group trie, once over budget."""
        if self.forest.num_nodes() > self.options.max_trie_nodes:
            self._evict()
        elif self.forest.tokens_appended - self._cross_since > self.options.cross_group_tokens:
            self._new_cross()  # the old trie is left as garbage for the next eviction
            self._cursor[self._cursor[:, 1] >= 0, 1] = UNSET

    def _evict(self) -> None:
        """Drop whole tries, in one compaction of the arena, until at most
        ``EVICT_TO`` of ``max_trie_nodes`` nodes remain: all garbage (tries
        of forgotten groups without live paths, restarted cross-group
        tries), then groups without live paths, least recently used first,
        then the cross-group trie, and only then live groups, least recently
        used first. Evicted groups are rebuilt when next used; their paths'
        cursors become ``UNSET`` and re-attach at the root (see _attach)."""
        roots = list(self._owners)
        sizes = self.forest.root_sizes(roots).tolist()
        ranks = [self._rank(root) for root in roots]
        left = self.forest.num_nodes()
        target = int(EVICT_TO * self.options.max_trie_nodes)
        gone = set()
        for i in sorted(range(len(roots)), key=ranks.__getitem__):
            if left <= target and ranks[i][0] > 0:
                break
            gone.add(roots[i])
            left -= sizes[i]
        self.nodes_evicted += self.forest.num_nodes() - left
        remap = self.forest.compact([r for r in roots if r not in gone])
        owners, self._owners = self._owners, {}
        for root, group in owners.items():
            if root not in gone:
                self._owners[int(remap[root])] = group
                if group is not None:
                    group.root, group.start = int(remap[group.root]), int(remap[group.start])
            elif group is not None:
                group.root = group.start = -1
                self.groups_evicted += 1
                self.live_groups_evicted += group.live > 0
        cursor = self._cursor
        held = cursor >= 0
        cursor[held] = remap[cursor[held]]
        cursor[held & (cursor < 0)] = UNSET  # its trie was dropped
        self.evictions += 1
        if self._cross_root in gone:
            self._new_cross()
        else:
            self._cross_root = int(remap[self._cross_root])

    def _rank(self, root: int) -> tuple[int, int]:
        """Eviction order: (class, last use); lowest goes first."""
        group = self._owners[root]
        if group is None:  # a cross-group trie: garbage unless the current one
            return (2 if root == self._cross_root else 0), 0
        if group.live:
            return 3, group.used
        return (1 if group.remembered else 0), group.used

    def _attached(self, paths) -> np.ndarray:
        """Checked path ids, each with a cursor into the current tries."""
        paths = np.asarray(paths, np.int64).reshape(-1)
        if paths.size and (paths.min() < 0 or paths.max() >= len(self._path_group)):
            raise ValueError("unknown path id")
        cursor = self._cursor[paths]
        for path in paths[(cursor[:, 0] == UNSET) | (cursor[:, 1] == UNSET)].tolist():
            self._attach(path)
        return paths

    def _grow(self) -> None:
        old = len(self._path_group)
        new = max(64, 2 * old)
        self._path_group.extend([None] * (new - old))
        self._free.extend(range(new - 1, old - 1, -1))  # lowest id first
        cursor = np.full((new, 2), UNSET, np.int64)
        cursor[:old] = self._cursor
        self._cursor = cursor

    def _new_cross(self) -> None:
        self._cross_root, self._cross_since = self.forest.new_root(), self.forest.tokens_appended
        self._owners[self._cross_root] = None

    def _cross_start(self) -> int:
        return self._cross_root if self.options.cross_group_weight > 0 else -1

    def _build(self, group: Group) -> None:
        """Give the group a trie holding its prompt tail, if it has none."""
        if group.root < 0:
            group.root = self.forest.new_root()
            tail = np.asarray(group.prompt_tail, np.int32)
            group.start = int(self.forest.extend_many([group.root], tail, [0, len(tail)])[0])
            self._owners[group.root] = group

    def _attach(self, path: int) -> None:
        """Point the path's unset cursors into the current tries. A cursor is
        unset mid-path (its trie was evicted or restarted), so it restarts at
        the trie's root with no context: appending there records only
        n-grams of the path's own output, never the prompt followed by
        whatever the path writes now."""
        group = self._path_group[path]
        if group is None:
            raise ValueError(f"path {path} was released")
        if self._cursor[path, 0] == UNSET:
            self._build(group)
            self._cursor[path, 0] = group.root
        if self._cursor[path, 1] == UNSET:
            self._cursor[path, 1] = self._cross_start()
