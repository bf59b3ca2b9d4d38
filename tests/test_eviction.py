"""Evicting whole tries from the arena: the forest's compaction and the
drafter's least-recently-used policy."""

import random

import numpy as np
import pytest

from consensus_spec import ConsensusDrafter, DrafterOptions
from consensus_spec.drafting.forest import UNSET, SuffixForest
from tests.reference_trie import SuffixTrie
from tests.test_forest import assert_same_trie, batch


def test_compaction_keeps_the_kept_tries_exactly_and_they_keep_growing():
    rng = random.Random(0)
    depth = 4
    forest = SuffixForest(depth, capacity=64)
    tries = [SuffixTrie(depth) for _ in range(6)]
    roots = np.array([forest.new_root() for _ in tries], np.int64)
    fnode, tnode = roots.copy(), [SuffixTrie.ROOT] * len(tries)

    def feed(rounds):
        nonlocal fnode
        for _ in range(rounds):
            chunks = [[rng.randrange(6) for _ in range(rng.randrange(6))] for _ in tries]
            fnode = forest.extend_many(fnode, *batch(chunks))
            for i, c in enumerate(chunks):
                tnode[i] = tries[i].extend(tnode[i], c)

    feed(40)
    assert forest.root_sizes(roots).tolist() == [len(t) for t in tries]
    keep = [1, 2, 4]
    remap = forest.compact(roots[keep])
    kept = remap >= 0
    assert (np.diff(remap[kept]) == 1).all() and remap[kept][0] == 0  # order kept, packed
    assert forest.num_nodes() == sum(len(tries[i]) for i in keep) == kept.sum()
    assert (remap[roots[[0, 3, 5]]] == -1).all()
    tries = [tries[i] for i in keep]
    roots, fnode, tnode = remap[roots[keep]], remap[fnode[keep]], [tnode[i] for i in keep]
    for root, trie in zip(roots, tries):
        assert_same_trie(forest, root, trie)
        assert forest.root(int(root)) == root
    feed(40)  # links, first children and hashed edges all renumbered
    for root, trie in zip(roots, tries):
        assert_same_trie(forest, root, trie)
    assert forest.root_sizes(roots).tolist() == [len(t) for t in tries]


def test_compaction_shrinks_an_emptied_table_and_checks_roots():
    rng = random.Random(1)
    forest = SuffixForest(6, capacity=64)
    big, small = forest.new_root(), forest.new_root()
    trie = SuffixTrie(6)
    trie.extend(SuffixTrie.ROOT, [1, 2, 1, 3, 1, 2])
    forest.extend_many([big, small], *batch([[rng.randrange(500) for _ in range(5000)],
                                             [1, 2, 1, 3, 1, 2]]))
    with pytest.raises(ValueError, match="root"):
        forest.compact([forest.num_nodes() - 1])  # not a root
    before = len(forest._table)
    remap = forest.compact([small])
    assert len(forest._table) == 64 < before and forest.num_nodes() == len(trie)
    assert_same_trie(forest, remap[small], trie)  # incl. 1's hashed second child
    assert forest.compact([]).max() == -1 and forest.num_nodes() == 0


def test_node_array_stops_doubling_past_its_soft_capacity():
    forest = SuffixForest(1, capacity=64, soft_capacity=1000)
    node = [forest.new_root()]
    for lo in range(0, 900, 100):
        node = forest.extend_many(node, np.arange(lo, lo + 100), [0, 100])
    assert forest.num_nodes() == 901 and len(forest._nodes) == 1000  # 64 ... 512, then 1000
    forest.extend_many(node, np.arange(900, 1100), [0, 200])
    assert forest.num_nodes() == 1101 and len(forest._nodes) == 1101 + 1000 // 64


def options(**kw):
    base = dict(max_depth=1, prompt_tokens=0, cross_group_weight=0.0, min_prob=0.0,
                max_trie_nodes=1000)
    return DrafterOptions(**{**base, **kw})


def fill(d, prompt, tokens):
    """A path of a new group whose trie is a root plus ``tokens`` distinct
    tokens (depth 1); returns it and its group."""
    p = d.add_path(prompt)
    d.extend([p], [list(tokens)])
    return p, d._path_group[p]


def has_trie(group):
    return group.root >= 0


def test_idle_groups_are_evicted_least_recently_used_first_live_ones_kept():
    d = ConsensusDrafter(options())
    a, ga = fill(d, [1], range(300))        # 301 nodes each; the cross-group trie is a root
    b, gb = fill(d, [2], range(300, 600))
    c, gc = fill(d, [3], range(600, 900))
    d.release(a)
    d.release(b)
    e, ge = fill(d, [4], range(1000, 1100))  # 1005 nodes > 1000
    assert d.evictions == 0
    d.extend([e], [[5]])  # makes room first: dropping a (301) leaves 704 <= 750
    assert (d.evictions, d.groups_evicted, d.nodes_evicted, d.live_groups_evicted) == (1, 1, 301, 0)
    assert not has_trie(ga) and has_trie(gb) and has_trie(gc) and has_trie(ge)
    assert d.num_nodes() == 1005 - 301 + 1
    for p, g in ((c, gc), (e, ge)):  # cursors renumbered with their tries
        assert d.forest.root(int(d._cursor[p, 0])) == g.root
    d.extend([c], [[600, 601]])  # known tokens at depth 1: no new node
    assert d.num_nodes() == 705
    a2 = d.add_path([1])  # group a's prompt again: its trie is rebuilt, empty
    assert d._path_group[a2] is ga and has_trie(ga) and d.num_nodes() == 706


def test_forgotten_groups_go_first_even_below_the_target():
    d = ConsensusDrafter(options(max_group_tokens=2))  # remembers two one-token prompts
    a, ga = fill(d, [1], range(300))
    d.release(a)
    a2, ga2 = fill(d, [2], range(300, 400))
    d.release(a2)
    c, gc = fill(d, [3], range(400, 700))       # forgets a's group
    live, gl = fill(d, [4], range(700, 1000))  # forgets a2's: 1 + 301 + 101 + 301 + 301 = 1005
    d.extend([live], [[1]])
    # dropping a is enough to get below 750, but a2 is garbage too
    assert (d.evictions, d.groups_evicted, d.nodes_evicted) == (1, 2, 402)
    assert not has_trie(ga) and not has_trie(ga2) and has_trie(gc) and has_trie(gl)
    idle, gi = fill(d, [5], range(1000, 1100))  # forgets c's group while c is live
    d.release(idle)
    d.release(c)  # c's trie is garbage now: it goes before the idle group, used less recently
    d.extend([live], [list(range(2000, 2300))])  # 1 + 302 + 301 + 101 + 300 = 1005
    d.extend([live], [[2]])
    assert (d.evictions, d.groups_evicted, d.nodes_evicted) == (2, 3, 703)
    assert not has_trie(gc) and has_trie(gi) and has_trie(gl)


def test_cross_group_trie_goes_before_live_groups():
    d = ConsensusDrafter(options(cross_group_weight=0.5))
    a, ga = fill(d, [1], range(300))          # each token goes to the cross-group trie too
    b, gb = fill(d, [2], range(300, 400))
    d.extend([a], [list(range(900, 1000))])  # 401 + 101 + 501 = 1003
    d.extend([b], [[7]])
    assert (d.evictions, d.groups_evicted, d.nodes_evicted) == (1, 0, 501)
    assert has_trie(ga) and has_trie(gb)
    assert d._cursor[a, 1] == UNSET  # re-attached at the new cross-group root when next used
    assert d.forest.root(int(d._cursor[b, 1])) == d._cross_root
    assert d.forest.root_sizes([d._cross_root]).tolist() == [2]  # root and 7


def test_live_groups_are_evicted_last_and_never_record_false_ngrams():
    """A path whose trie is evicted mid-generation restarts at the rebuilt
    trie's root: what it appends next must not look like it followed the prompt."""
    d = ConsensusDrafter(options(max_depth=2, prompt_tokens=4, cross_group_weight=0.5))
    prompt = [100, 101, 102, 103]
    a = d.add_path(prompt)
    group = d._path_group[a]
    d.extend([a], [list(range(200, 400))])  # 408 nodes in a's trie, 400 in the cross trie
    other, go = fill(d, [5, 6], range(1000, 1340))  # 684 nodes; a's group is the older live one
    d.extend([other], [[8]])  # drops the cross-group trie, then a's group
    assert d.live_groups_evicted == 1 and not has_trie(group) and has_trie(go)
    assert d._cursor[a, 0] == UNSET
    d.extend([a], [[7, 9]])  # the trie is rebuilt and a re-attached at its root
    f, root = d.forest, group.root
    assert f.child(f.child(root, 102), 103) >= 0  # the prompt tail is back
    assert f.child(f.child(root, 103), 7) == -1   # (103, 7) never occurred
    assert f.child(f.child(root, 7), 9) >= 0      # (7, 9) did
    b = d.add_path(prompt)  # a new path does continue the prompt
    d.extend([b], [[7]])
    assert f.child(f.child(root, 103), 7) >= 0


def test_eviction_changes_no_draft_of_a_kept_group():
    """Drafters with and without evictions of idle groups, fed the same
    steps, draft identically for live paths (kept tries only move)."""
    rng = random.Random(2)
    opts = dict(max_depth=4, prompt_tokens=8, cross_group_weight=0.0, min_prob=0.0)
    small = ConsensusDrafter(DrafterOptions(**opts, max_trie_nodes=4000))
    big = ConsensusDrafter(DrafterOptions(**opts, max_trie_nodes=10_000_000))
    for g in range(40):
        prompt = [1000 + g] + [rng.randrange(30) for _ in range(8)]
        paths = [(small.add_path(prompt), big.add_path(prompt)) for _ in range(4)]
        ps, pb = [p for p, _ in paths], [p for _, p in paths]
        base = [rng.randrange(30) for _ in range(60)]
        for step in range(0, 60, 3):
            toks = [[t if rng.random() < 0.8 else rng.randrange(30) for t in base[step:step + 3]]
                    for _ in paths]
            small.extend(ps, toks)
            big.extend(pb, toks)
            for x, y in zip(small.draft(ps, [5] * 4), big.draft(pb, [5] * 4)):
                assert (x == y).all()
        for p, q in paths:
            small.release(p)
            big.release(q)
    assert small.evictions > 3 and small.live_groups_evicted == 0 and big.evictions == 0
    assert len(small.forest._nodes) <= 4000 + 4000 // 64 + 4 * 3 * 2 * 4 + 9 * 4
