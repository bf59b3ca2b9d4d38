import random

import pytest

from tests.reference_trie import SuffixTrie


def count_occurrences(seqs, sub):
    n = len(sub)
    return sum(1 for s in seqs for i in range(len(s) - n + 1) if s[i:i + n] == sub)


def walk(trie, tokens):
    n = SuffixTrie.ROOT
    for t in tokens:
        c = trie._edges.get((n << 21) | t)
        if c is None:
            return None
        n = c
    return n


def test_counts_equal_substring_occurrences():
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    trie = SuffixTrie(max_depth=5)
    for s in seqs:
        node = SuffixTrie.ROOT
        for i in range(0, len(s), 3):  # appends in chunks, as rows advance
            node = trie.extend(node, s[i:i + 3])
    for _ in range(300):
        s = rng.choice(seqs)
        i = rng.randrange(len(s))
        sub = s[i:i + rng.randrange(1, 6)]
        node = walk(trie, sub)
        assert node is not None
        assert trie._count[node] == count_occurrences(seqs, sub)
    assert walk(trie, [9]) is None


def test_extend_returns_longest_suffix_node():
    trie = SuffixTrie(max_depth=3)
    node = trie.extend(SuffixTrie.ROOT, [1, 2, 3, 4, 5])
    assert node == walk(trie, [3, 4, 5])
    assert trie.depth(node) == 3


def test_top_prefers_majority_and_backs_off():
    trie = SuffixTrie(max_depth=4)
    for cont in ([7], [7], [8]):
        trie.extend(SuffixTrie.ROOT, [1, 2, 3] + cont)
    node = walk(trie, [1, 2, 3])
    tok, count, total, depth, _ = trie.top(node)
    assert (tok, count, total, depth) == (7, 2, 3, 3)
    # a context never seen continued backs off to the longest one that was
    lone = trie.extend(SuffixTrie.ROOT, [5, 2, 3])
    assert trie.top(lone)[0] == 7
    assert trie.top(lone, min_depth=3) is None


def test_step_and_match_follow_suffix_links():
    trie = SuffixTrie(max_depth=4)
    trie.extend(SuffixTrie.ROOT, [1, 2, 3, 4, 5, 6])
    assert trie.match([9, 9, 3, 4]) == walk(trie, [3, 4])
    assert trie.step(walk(trie, [1, 2, 3, 4]), 5) == walk(trie, [2, 3, 4, 5])
    assert trie.match([9, 9]) == SuffixTrie.ROOT


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        SuffixTrie(max_depth=0)
    with pytest.raises(ValueError):
        SuffixTrie().extend(SuffixTrie.ROOT, [-1])
