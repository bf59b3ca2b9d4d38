"""SuffixForest against the pure-Python reference (SuffixTrie, joint_draft).

``python -m tests.test_forest`` prints a timing comparison (no assertions).
"""

import random
import time
from collections import defaultdict

import numpy as np
import pytest

from consensus_spec.drafting.forest import BEST, CNT, DEP, LINK, TOT, ForestFull, SuffixForest
from tests.reference_trie import SuffixTrie, joint_draft


def batch(chunks):
    """(tokens, offsets) for extend_many from a list of token lists."""
    offsets = np.zeros(len(chunks) + 1, np.int64)
    offsets[1:] = np.cumsum([len(c) for c in chunks])
    tokens = np.array([t for c in chunks for t in c], np.int32)
    return tokens, offsets


def assert_same_trie(forest, root, trie):
    """Node-for-node: counts, totals, depths, best children, suffix links, root."""
    kids = defaultdict(list)
    for key, c in trie._edges.items():
        kids[key >> 21].append((key & ((1 << 21) - 1), c))
    fmap, stack = {0: root}, [0]
    while stack:
        t = stack.pop()
        for tok, c in kids[t]:
            fmap[c] = forest.child(fmap[t], tok)
            assert fmap[c] >= 0
            stack.append(c)
    assert len(fmap) == len(trie)
    nodes = forest._nodes
    for t, f in fmap.items():
        assert nodes[f, DEP] == trie._depth[t]
        assert nodes[f, CNT] == trie._count[t]
        assert nodes[f, TOT] == trie._total[t]
        assert nodes[f, BEST] == (fmap[trie._best[t]] if trie._best[t] >= 0 else -1)
        assert nodes[f, LINK] == fmap[trie._link[t]]
        assert forest.root(f) == root
    assert forest.root_sizes([root]).tolist() == [len(trie)]


def count_occurrences(seqs, sub):
    n = len(sub)
    return sum(1 for s in seqs for i in range(len(s) - n + 1) if s[i:i + n] == sub)


@pytest.mark.parametrize("max_depth,vocab,seed", [(1, 3, 0), (4, 3, 1), (6, 8, 2)])
def test_matches_suffix_tries_fed_in_chunks(max_depth, vocab, seed):
    rng = random.Random(seed)
    forest = SuffixForest(max_depth, capacity=1 << 14)
    tries = [SuffixTrie(max_depth) for _ in range(4)]
    roots = [forest.new_root() for _ in tries]
    # three sequences per trie, all advanced together, one extend_many per round
    seqs = [(t, [rng.randrange(vocab) for _ in range(rng.randrange(40))]) for t in range(4)
            for _ in range(3)]
    pos = [0] * len(seqs)
    tnode = [0] * len(seqs)
    fnode = np.array([roots[t] for t, _ in seqs], np.int64)
    while any(p < len(s) for p, (_, s) in zip(pos, seqs)):
        chunks = []
        for i, (t, s) in enumerate(seqs):
            n = rng.randrange(5)
            chunks.append(s[pos[i]:pos[i] + n])
            pos[i] += n
            tnode[i] = tries[t].extend(tnode[i], chunks[-1])
        fnode = forest.extend_many(fnode, *batch(chunks))
        assert [forest.depth(n) for n in fnode] == [tries[t].depth(n)
                                                     for n, (t, _) in zip(tnode, seqs)]
    for t, trie in enumerate(tries):
        assert_same_trie(forest, roots[t], trie)
        mine = [s for u, s in seqs if u == t]
        for _ in range(50):  # and the counts mean substring occurrences
            s = rng.choice(mine) or [0]
            i = rng.randrange(len(s))
            sub = s[i:i + rng.randint(1, max_depth)]
            node = roots[t]
            for tok in sub:
                node = forest.child(node, tok)
            assert node >= 0 and forest.count(node) == count_occurrences(mine, sub)
    assert forest.num_nodes() == sum(len(t) for t in tries)


def test_halves_fill_and_rotate_without_touching_the_young_half():
    """A trie stays in the half it started in; a full half refuses the call
    (changing nothing) and rotate() drops only the old half."""
    rng = random.Random(3)
    forest = SuffixForest(max_depth=5, capacity=4000)  # 2000 nodes a half
    tries = [SuffixTrie(5) for _ in range(3)]
    roots = [forest.new_root() for _ in tries]
    assert forest.half_of(roots).tolist() == [0, 0, 0]
    seqs = [[rng.randrange(50) for _ in range(400)] for _ in tries]
    fnode, tnode = np.array(roots, np.int64), [0] * 3
    with pytest.raises(ForestFull) as full:
        for i in range(0, 400, 25):
            chunks = [s[i:i + 25] for s in seqs]
            before = forest.num_nodes(0)
            fnode = forest.extend_many(fnode, *batch(chunks))
            tnode = [t.extend(n, c) for t, n, c in zip(tries, tnode, chunks)]
    assert full.value.half == 0 and forest.num_nodes(0) == before > 300
    for root, trie in zip(roots, tries):  # the refused call changed nothing
        assert_same_trie(forest, root, trie)
    assert forest.rotate() == 1 and forest.young == 1  # drops the (empty) old half
    fresh, fresh_trie = forest.new_root(), SuffixTrie(5)
    assert forest.half_of([fresh]).tolist() == [1]
    node = forest.extend_many([fresh], seqs[0][:30], [0, 30])
    fresh_trie.extend(0, seqs[0][:30])
    assert forest.rotate() == 0 and forest.num_nodes(0) == 0  # drops half 0, keeps half 1
    assert forest._dirty is not None and forest._dirty.any()   # half 1's old table, to clear
    calls = 0
    while forest._dirty is not None:  # a bounded slice a call
        forest.tidy(slots=64)
        calls += 1
    assert calls == forest._slots // 64 and not forest._spare.any()
    assert_same_trie(forest, fresh, fresh_trie)
    with pytest.raises(ValueError):
        forest.extend_many([roots[0]], [1], [0, 1])  # its trie was dropped
    forest.extend_many(node, [7], [0, 1])
    assert forest.num_nodes() == forest.num_nodes(1) == len(fresh_trie) + 5


def test_bad_input_raises_and_leaves_forest_untouched():
    forest = SuffixForest(max_depth=3)
    r = forest.new_root()
    node = forest.extend_many([r], [1, 2, 3], [0, 3])
    before = forest.num_nodes()
    for bad in (-1, 1 << 21):
        with pytest.raises(ValueError, match="token id"):
            forest.extend_many([node[0], r], [4, 5, bad], [0, 2, 3])
    with pytest.raises(ValueError):
        forest.extend_many([before], [1], [0, 1])  # no such node
    with pytest.raises(ValueError):
        forest.extend_many([r], [1], [0])  # offsets too short
    with pytest.raises(ValueError):
        forest.draft_many([r], [before], 0.5, [2], 2, 0.0, 1, 0.0)
    assert forest.num_nodes() == before
    assert forest.extend_many([node[0]], [], [0, 0])[0] == node[0]  # nothing appended


OPTIONS = [
    dict(max_depth=4, min_prob=0.0, min_match=1, prior=0.0, weight=0.8),
    dict(max_depth=6, min_prob=0.1, min_match=2, prior=0.5, weight=0.5),
    dict(max_depth=3, min_prob=0.3, min_match=1, prior=1.0, weight=1.0),
    dict(max_depth=5, min_prob=0.05, min_match=3, prior=0.0, weight=0.0),
    dict(max_depth=8, min_prob=0.0, min_match=1, prior=0.0, weight=0.6, vocab=12),
]


@pytest.mark.parametrize("opts", OPTIONS)
def test_draft_many_matches_the_reference_walk(opts):
    """Group tries plus one cross-group trie, fed identically to a forest and
    to SuffixTries; draft_many must equal trie.joint_draft row by row."""
    rng = random.Random(str(opts))
    o = dict(opts)
    vocab = o.pop("vocab", 5)  # larger: shallower matches, more back-off
    depth, weight = o["max_depth"], o["weight"]
    forest = SuffixForest(depth, capacity=1 << 16)
    cross_f, cross_t = forest.new_root(), SuffixTrie(depth)
    k = 6
    rows = []  # [group trie, group node, cross node, forest group node, forest cross node]
    for g in range(5):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(8))] + [100 + g]
        trie = SuffixTrie(depth)
        start_t = trie.extend(SuffixTrie.ROOT, prompt)
        start_f = forest.extend_many([forest.new_root()], *batch([prompt]))[0]
        for _ in range(rng.randint(1, 4)):
            rows.append([trie, start_t, SuffixTrie.ROOT, start_f, cross_f])

    def compare(use_a=True, use_b=True):
        max_tokens = np.array([rng.randint(0, k) for _ in rows], np.int32)
        fa = np.array([r[3] if use_a else -1 for r in rows], np.int64)
        fb = np.array([r[4] if use_b else -1 for r in rows], np.int64)
        toks, probs, lens = forest.draft_many(fa, fb, weight, max_tokens, k,
                                              o["min_prob"], o["min_match"], o["prior"])
        for i, r in enumerate(rows):
            sources = ([(r[0], r[1], 1.0)] if use_a else []) + ([(cross_t, r[2], weight)] if use_b else [])
            want, want_p = joint_draft(sources, int(max_tokens[i]), o["min_prob"], o["min_match"], o["prior"])
            assert toks[i, :lens[i]].tolist() == want
            assert probs[i, :lens[i]].tolist() == pytest.approx(want_p, rel=1e-12)
        return lens.sum()

    drafted = 0
    for _ in range(30):
        chunks = [[rng.randrange(vocab) for _ in range(rng.randrange(4))] for _ in rows]
        for r, c in zip(rows, chunks):
            r[1] = r[0].extend(r[1], c)
            r[2] = cross_t.extend(r[2], c)
        out = forest.extend_many([r[3] for r in rows] + [r[4] for r in rows], *batch(chunks + chunks))
        for i, r in enumerate(rows):
            r[3], r[4] = int(out[i]), int(out[len(rows) + i])
        drafted += compare()
    assert drafted > 0
    compare(use_b=False)  # rows without a cross-group source
    compare(use_a=False)  # rows whose only source is the cross-group trie


def bench(steps=110, warmup=10, k=8, per_group=8, history=1000, prompt_len=256):
    """Per-row µs of one step (append 3 tokens to each row's group and
    cross-group tries, then draft k) for the forest and the pure-Python
    reference, on siblings that mostly agree (10% of tokens resampled).
    Medians over steps, as the 2 shared cores see other tenants' spikes."""
    rng = np.random.default_rng(0)
    depth, weight, min_prob, min_match, prior = 12, 0.8, 0.05, 1, 0.0
    for rows in (16, 128):
        forest = SuffixForest(depth, capacity=1 << 24)
        cross_f, cross_t = forest.new_root(), SuffixTrie(depth)
        seqs, fa, ta = [], [], []
        for g in range(rows // per_group):
            prompt = rng.integers(0, 32000, prompt_len).tolist()
            base = rng.integers(0, 32000, history + 3 * steps)
            pnode = forest.extend_many([forest.new_root()], *batch([prompt]))[0]
            trie = SuffixTrie(depth)
            tnode = trie.extend(SuffixTrie.ROOT, prompt)
            for _ in range(per_group):
                s = base.copy()
                noise = rng.random(len(s)) < 0.1
                s[noise] = rng.integers(0, 32000, noise.sum())
                seqs.append(s.tolist())
                fa.append(pnode)
                ta.append([trie, tnode, SuffixTrie.ROOT])
        hist = [s[:history] for s in seqs]
        out = forest.extend_many(np.concatenate([fa, np.full(rows, cross_f)]), *batch(hist + hist))
        fa, fb = out[:rows], out[rows:]
        for r, h in zip(ta, hist):
            r[1], r[2] = r[0].extend(r[1], h), cross_t.extend(r[2], h)
        chunks = [[s[history + 3 * t: history + 3 * t + 3] for s in seqs] for t in range(steps)]
        batches = [batch(c + c) for c in chunks]
        max_tokens = np.full(rows, k, np.int32)
        start_nodes = forest.num_nodes()
        times = np.zeros((2, 2, steps))  # (forest, python) x (extend, draft) x step
        lens = np.zeros((2, steps))
        for t in range(steps):
            t0 = time.perf_counter()
            out = forest.extend_many(np.concatenate([fa, fb]), *batches[t])
            fa, fb = out[:rows], out[rows:]
            t1 = time.perf_counter()
            lens[0, t] = forest.draft_many(fa, fb, weight, max_tokens, k, min_prob, min_match, prior)[2].mean()
            times[0, :, t] = t1 - t0, time.perf_counter() - t1
        new_nodes = (forest.num_nodes() - start_nodes) / (steps * rows)
        for t in range(steps):
            t0 = time.perf_counter()
            for r, c in zip(ta, chunks[t]):
                r[1], r[2] = r[0].extend(r[1], c), cross_t.extend(r[2], c)
            t1 = time.perf_counter()
            lens[1, t] = np.mean([len(joint_draft([(r[0], r[1], 1.0), (cross_t, r[2], weight)], k,
                                                  min_prob, min_match, prior)[0]) for r in ta])
            times[1, :, t] = t1 - t0, time.perf_counter() - t1
        us = 1e6 * np.median(times[:, :, warmup:], axis=2) / rows
        step = 1e6 * times[:, :, warmup:].sum(axis=1) / rows
        for name, j in (("forest", 0), ("python", 1)):
            print(f"{rows:4d} rows {name}: extend {us[j, 0]:6.2f} + draft {us[j, 1]:6.2f} us/row"
                  f" (median step; p90 {np.percentile(step[j], 90):6.2f}, mean {step[j].mean():6.2f})"
                  f"  avg draft {lens[j, warmup:].mean():.2f}")
        print(f"          {forest.num_nodes()} nodes, +{new_nodes:.0f} per row per step")


if __name__ == "__main__":
    bench()


def test_commit_backs_every_page_and_changes_nothing():
    """commit() makes the arrays resident (a server's memory is then the
    arena's bound from the start, not growing to it as nodes are written)
    without changing a node or an edge."""
    from tests.process_memory import resident_bytes

    forest = SuffixForest(4, capacity=1 << 16)
    root = forest.new_root()
    forest.extend_many([root], *batch([[1, 2, 3, 1, 2, 4] * 20]))
    arrays = [forest._nodes, *forest._tables, forest._spare]
    ranges = [[a.ctypes.data, a.nbytes] for a in arrays]
    assert resident_bytes(ranges) < forest.nbytes / 4
    before = [a.copy() for a in arrays]  # (reading shared anonymous pages backs them too)
    forest.commit()
    assert resident_bytes(ranges) >= forest.nbytes * 0.99
    assert all(np.array_equal(a, b) for a, b in zip(arrays, before))


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text.split("[")[1].split("]")[0] if "[" in text else None


def test_commit_asks_for_huge_pages_where_the_os_has_them():
    """commit() asks the OS to back the arena with transparent huge pages
    (trie walks are random reads over the whole arena: with 4 KB pages they
    miss the TLB too); an arena never committed is left to 4 KB pages, so no
    step ever waits on a huge-page fault. Contents are unchanged either way."""
    forest = SuffixForest(4, capacity=1 << 18)
    root = forest.new_root()
    end = forest.extend_many([root], *batch([[1, 2, 3, 1, 2, 4] * 20]))
    assert forest.huge_pages is False
    before = forest.draft_many(end, np.full(1, -1), 0.0, np.full(1, 4, np.int32), 4,
                               0.0, 1, 0.5)
    forest.commit()
    mode = _thp_mode()
    assert forest.huge_pages is (mode in ("always", "madvise"))
    after = forest.draft_many(end, np.full(1, -1), 0.0, np.full(1, 4, np.int32), 4,
                              0.0, 1, 0.5)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert before[2][0] > 0  # the walk drafted something to compare
