"""Dropping whole tries without a pause: the arena's two halves take turns
(rotation), so freeing memory never walks the nodes."""

import random

import numpy as np

from consensus_spec import ConsensusDrafter, DrafterOptions
from consensus_spec.drafting.drafter import OLD_FULL_AT, ROTATE_AT
from consensus_spec.drafting.forest import UNSET


def options(**kw):
    base = dict(max_depth=2, prompt_tokens=0, cross_group_weight=0.0, min_prob=0.0,
                max_trie_nodes=4000)
    return DrafterOptions(**{**base, **kw})


def half_of(d, group):
    return int(d.forest.half_of([d.group_root(group)])[0])


def feed_until_rotation(d, path, start=10_000, chunk=50):
    """Extend ``path`` with fresh tokens until the drafter rotates once."""
    before, tok = d.evictions, start
    while d.evictions == before:
        d.extend([path], [list(range(tok, tok + chunk))])
        tok += chunk
    return tok


def test_rotation_drops_only_the_old_half_idle_groups_first():
    d = ConsensusDrafter(options())
    arrays = d.forest._nodes, d.arena_bytes
    a = d.add_path([1])
    ga = d.group_of(a)
    d.extend([a], [list(range(100, 200))])
    d.release(a)                                   # idle, in half 0
    b = d.add_path([2])
    gb = d.group_of(b)
    assert half_of(d, ga) == half_of(d, gb) == 0 and d.forest.young == 0
    feed_until_rotation(d, b)                      # half 0 past ROTATE_AT: half 1 becomes young
    assert d.forest.young == 1 and d.nodes_evicted == 0 and d.groups_evicted == 0
    assert d.group_root(ga) >= 0 and d.group_root(gb) >= 0          # the dropped half was empty
    assert d.forest.fill(0) > ROTATE_AT               # why it rotated
    c = d.add_path([3])
    gc = d.group_of(c)
    assert half_of(d, gc) == 1                     # new tries start in the young half
    nodes0 = d.forest.num_nodes(0)
    d.extend([b], [[7, 8, 9]])                     # b keeps appending to its own (old) half
    assert d.forest.num_nodes(0) > nodes0
    d.release(b)
    held = d.forest.num_nodes(0)
    feed_until_rotation(d, c, start=50_000)        # half 1 full: half 0 is dropped whole
    assert d.forest.young == 0 and d.group_root(ga) == d.group_root(gb) == -1 and d.group_root(gc) >= 0
    assert d.groups_evicted == 2 and d.live_groups_evicted == 0 and d.nodes_evicted == held > 500
    assert d.forest._nodes is arrays[0] and d.arena_bytes == arrays[1]  # nothing grew or moved
    a2 = d.add_path([1])                           # a's prompt again: rebuilt, in the young half
    assert d.group_of(a2) == ga and half_of(d, ga) == 0


def test_a_live_group_in_a_dropped_half_restarts_at_its_root_without_false_ngrams():
    """A path whose trie is dropped mid-generation re-attaches at the root of
    a rebuilt trie: what it appends next must not look like it followed the prompt."""
    d = ConsensusDrafter(options(prompt_tokens=4, cross_group_weight=0.5))
    prompt = [100, 101, 102, 103]
    a = d.add_path(prompt)
    group = d.group_of(a)
    d.extend([a], [list(range(200, 260))])
    other = d.add_path([5, 6])
    tok = feed_until_rotation(d, other)            # half 0 retires (a, other and the cross trie in it)
    d.release(other)
    other2 = d.add_path([5, 7])
    feed_until_rotation(d, other2, start=tok)      # half 1 full: half 0 dropped, a still live
    assert d.live_groups_evicted == 1 and d.group_root(group) == -1
    assert d._cursor[a, 0] == UNSET and d._cursor[a, 1] == UNSET
    d.extend([a], [[7, 9]])                        # rebuilt; a re-attached at its root
    f, root = d.forest, d.group_root(group)
    assert f.child(f.child(root, 102), 103) >= 0   # the prompt tail is back
    assert f.child(f.child(root, 103), 7) == -1    # (103, 7) never occurred
    assert f.child(f.child(root, 7), 9) >= 0       # (7, 9) did
    assert d.forest.root(int(d._cursor[a, 1])) == d.cross_root  # a new cross-group trie
    b = d.add_path(prompt)                         # a new path does continue the prompt
    d.extend([b], [[7]])
    assert f.child(f.child(root, 103), 7) >= 0


def test_an_old_half_filled_by_its_live_paths_is_dropped_early():
    d = ConsensusDrafter(options())
    a = d.add_path([1])
    tok = feed_until_rotation(d, a)                # a's trie is in the old half now
    assert d.forest.young == 1 and d.evictions == 1
    while d.evictions == 1:                        # a alone fills the old half
        d.extend([a], [list(range(tok, tok + 20))])
        tok += 20
        assert d.forest.fill(0) <= OLD_FULL_AT + 0.05 or d.evictions == 2
    assert d.live_groups_evicted == 1 and d.forest.young == 0
    d.extend([a], [[1, 2]])                        # drafting goes on from a rebuilt trie
    assert d.group_root(d.group_of(a)) >= 0 and d.draft([a], [2])[2].shape == (1,)


def test_rotation_changes_no_draft_of_a_live_group():
    """Drafters with and without rotations, fed the same steps, draft
    identically for live paths: only idle groups' tries are dropped."""
    rng = random.Random(2)
    opts = dict(max_depth=4, prompt_tokens=8, cross_group_weight=0.0, min_prob=0.0)
    small = ConsensusDrafter(DrafterOptions(**opts, max_trie_nodes=16_000))
    big = ConsensusDrafter(DrafterOptions(**opts, max_trie_nodes=10_000_000))
    arrays = small.forest._nodes
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
    assert small.forest._nodes is arrays and small.num_nodes() <= 16_000


def test_extend_and_draft_rotates_and_reattaches_within_one_call():
    """The proposer's one call per step: a rotation it needs happens inside,
    and every row still gets its draft."""
    d = ConsensusDrafter(options(cross_group_weight=0.5))
    paths = [d.add_path([1]), d.add_path([1])]
    buf = np.zeros((2, 4000), np.int64)
    buf[:] = np.arange(20_000, 24_000)
    pos = 0
    while d.evictions < 3:
        out = d.extend_and_draft(paths, buf, [0, 1], [pos, pos], [pos + 10, pos + 10], [3, 3])
        assert out is not None and out[2].shape == (2,)
        pos += 10
        assert pos < 4000
    assert d.live_groups_evicted >= 1
