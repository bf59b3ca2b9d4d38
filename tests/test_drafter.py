import random
import tracemalloc

import pytest

from consensus_spec import ConsensusDrafter, DrafterOptions

PROMPT = [100, 101, 102, 103]


def draft(drafter, path, k):
    toks, probs, lengths = drafter.draft([path], [k])
    return toks[0, :lengths[0]].tolist(), probs[0, :lengths[0]].tolist()


def tokens(drafter, path, k):
    return draft(drafter, path, k)[0]


def extend(drafter, path, toks):
    drafter.extend([path], [toks])


def test_drafts_what_siblings_wrote_after_the_same_context():
    d = ConsensusDrafter(DrafterOptions(min_prob=0.0))
    a, b = d.add_path(PROMPT), d.add_path(PROMPT)
    extend(d, a, [1, 2, 3, 4, 5, 6, 7])
    extend(d, b, [1, 2, 3])
    assert tokens(d, b, 4) == [4, 5, 6, 7]
    assert tokens(d, b, 2) == [4, 5]
    assert d.num_groups == 1


def test_majority_wins_and_disagreement_ends_the_draft():
    d = ConsensusDrafter(DrafterOptions(min_prob=0.5, cross_group_weight=0.0))
    paths = [d.add_path(PROMPT) for _ in range(4)]
    for p, tail in zip(paths[:3], ([9, 9], [9, 8], [9, 7])):
        extend(d, p, [1, 2] + tail)
    extend(d, paths[3], [1, 2])
    # all three agree on 9, then split three ways: 1/3 < 0.5 stops the draft
    assert tokens(d, paths[3], 8) == [9]


def test_other_prompts_do_not_count_as_siblings():
    d = ConsensusDrafter(DrafterOptions(min_prob=0.0, cross_group_weight=0.0))
    other = d.add_path([7, 7, 7])
    extend(d, other, [1, 2, 3, 4])
    mine = d.add_path(PROMPT)
    extend(d, mine, [1, 2])
    assert tokens(d, mine, 4) == []
    assert d.num_groups == 2


def test_cross_group_fallback_when_siblings_have_nothing():
    d = ConsensusDrafter(DrafterOptions(min_prob=0.0, cross_group_weight=0.5))
    other = d.add_path([7, 7, 7])
    extend(d, other, [1, 2, 3, 4])
    mine = d.add_path(PROMPT)
    extend(d, mine, [1, 2])
    assert tokens(d, mine, 2) == [3, 4]


def test_siblings_outrank_other_groups():
    d = ConsensusDrafter(DrafterOptions(min_prob=0.0, cross_group_weight=0.5))
    for _ in range(3):  # a popular continuation elsewhere
        p = d.add_path([7, 7, 7])
        extend(d, p, [1, 2, 3, 9])
    sib = d.add_path(PROMPT)
    extend(d, sib, [1, 2, 3, 5])
    mine = d.add_path(PROMPT)
    extend(d, mine, [1, 2, 3])
    assert tokens(d, mine, 1) == [5]


def test_draft_length_follows_confidence_and_cap():
    d = ConsensusDrafter(DrafterOptions(min_prob=0.3, cross_group_weight=0.0, prior=0.0))
    paths = [d.add_path(PROMPT) for _ in range(3)]
    extend(d, paths[0], [1, 2, 3, 4, 5, 6])
    extend(d, paths[1], [1, 2, 3, 8, 8, 8])
    extend(d, paths[2], [1, 2])
    toks, probs = draft(d, paths[2], 8)
    # 3 is certain; after it the two siblings split 1:1: P = 0.5, then 0.5 * 1 ...
    assert toks[:2] == [3, 4] and probs[:2] == [1.0, 0.5]
    assert all(a >= b for a, b in zip(probs, probs[1:]))
    assert tokens(d, paths[2], 1) == [3]
    assert tokens(d, paths[2], 0) == []


def test_unknown_or_invalid_options_are_clear_errors():
    with pytest.raises(ValueError, match="unknown drafter option"):
        DrafterOptions.from_dict({"min_porb": 0.2})
    with pytest.raises(ValueError):
        DrafterOptions(min_prob=2.0)
    with pytest.raises(ValueError):
        DrafterOptions(min_match=5, max_depth=4)


def test_memory_stays_flat_over_ten_thousand_paths():
    rng = random.Random(0)
    limit = 200_000
    d = ConsensusDrafter(DrafterOptions(max_group_tokens=20_000, cross_group_tokens=20_000,
                                        max_trie_nodes=limit))
    vocab = list(range(50))

    def run_groups(n_groups):
        peak = 0
        for g in range(n_groups):
            prompt = [1000 + g % 997, 2000 + g // 997] + rng.sample(vocab, 6)
            paths = [d.add_path(prompt) for _ in range(8)]
            for _ in range(10):
                d.extend(paths, [[rng.choice(vocab) for _ in range(3)] for _ in paths])
                d.draft(paths, [4] * len(paths))
            peak = max(peak, d.num_nodes())
            for p in paths:
                d.release(p)
        return peak

    run_groups(250)  # 2,000 paths: caches reach their budgets
    tracemalloc.start()
    run_groups(250)
    warm, _ = tracemalloc.get_traced_memory()
    group_slots = d.group_slots
    peak = run_groups(1000)  # 8,000 more paths
    end, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # at most one step's worth of nodes past the arena limit, and arrays to match
    assert peak <= limit + 2 * 8 * 3 * 12 + 8 * 12
    assert len(d.forest._nodes) <= limit + limit // 64 + 2 * 8 * 3 * 12 + 8 * 12
    assert d.evictions > 10 and d.live_groups_evicted == 0  # only finished groups went
    assert 0 < d.eviction_max_s <= d.eviction_s  # each rotation timed
    assert d.num_groups <= 20_000 // 8
    assert d.num_paths == 0 and len(d._path_group) == 64  # released ids are reused
    # group rows: remembered groups (20,000 prompt tokens, 16 a group: 1,250)
    # and forgotten ones whose tries are still in the arena (a few hundred)
    assert group_slots <= d.group_slots <= 2048
    # 8,000 paths' Python objects come and go; the arena is bounded numpy memory
    assert end < warm + 4_000_000, (warm, end)


def test_released_paths_are_reused_and_stale_ids_are_errors():
    d = ConsensusDrafter(DrafterOptions(min_prob=0.0))
    a = d.add_path(PROMPT)
    extend(d, a, [1, 2, 3])
    d.release(a)
    with pytest.raises(ValueError, match="released"):
        d.draft([a], [2])
    with pytest.raises(ValueError, match="no such path"):
        d.release(a)
    with pytest.raises(ValueError, match="unknown path"):
        d.draft([10_000], [2])
    b = d.add_path(PROMPT)
    assert b == a and d.num_paths == 1
    extend(d, b, [1, 2])  # the new path starts at the prompt, not where a left off
    assert tokens(d, b, 1) == [3]


def test_extend_from_a_token_buffer_equals_extend_from_lists():
    rng = random.Random(1)
    buf = [[rng.randrange(20) for _ in range(30)] for _ in range(3)]
    a, b = ConsensusDrafter(), ConsensusDrafter()
    pa = [a.add_path(PROMPT) for _ in range(3)]
    pb = [b.add_path(PROMPT) for _ in range(3)]
    for lo in range(0, 30, 5):
        a.extend(pa, [row[lo:lo + 5] for row in buf])
        b.extend_from(pb, buf, [0, 1, 2], [lo] * 3, [lo + 5] * 3)
        ta, pra, la = a.draft(pa, [6] * 3)
        tb, prb, lb = b.draft(pb, [6] * 3)
        assert (ta == tb).all() and (pra == prb).all() and (la == lb).all()
