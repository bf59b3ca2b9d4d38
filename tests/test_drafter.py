import random
import tracemalloc

import pytest

from consensus_spec import ConsensusDrafter, DrafterOptions

PROMPT = [100, 101, 102, 103]


def tokens(drafter, path, k):
    return drafter.draft(path, k)[0]


def test_drafts_what_siblings_wrote_after_the_same_context():
    d = ConsensusDrafter(DrafterOptions(min_prob=0.0))
    a, b = d.add_path(PROMPT), d.add_path(PROMPT)
    d.extend(a, [1, 2, 3, 4, 5, 6, 7])
    d.extend(b, [1, 2, 3])
    assert tokens(d, b, 4) == [4, 5, 6, 7]
    assert tokens(d, b, 2) == [4, 5]
    assert d.num_groups == 1


def test_majority_wins_and_disagreement_ends_the_draft():
    d = ConsensusDrafter(DrafterOptions(min_prob=0.5, cross_group_weight=0.0))
    paths = [d.add_path(PROMPT) for _ in range(4)]
    for p, tail in zip(paths[:3], ([9, 9], [9, 8], [9, 7])):
        d.extend(p, [1, 2] + tail)
    d.extend(paths[3], [1, 2])
    # all three agree on 9, then split three ways: 1/3 < 0.5 stops the draft
    assert tokens(d, paths[3], 8) == [9]


def test_other_prompts_do_not_count_as_siblings():
    d = ConsensusDrafter(DrafterOptions(min_prob=0.0, cross_group_weight=0.0))
    other = d.add_path([7, 7, 7])
    d.extend(other, [1, 2, 3, 4])
    mine = d.add_path(PROMPT)
    d.extend(mine, [1, 2])
    assert tokens(d, mine, 4) == []
    assert d.num_groups == 2


def test_cross_group_fallback_when_siblings_have_nothing():
    d = ConsensusDrafter(DrafterOptions(min_prob=0.0, cross_group_weight=0.5))
    other = d.add_path([7, 7, 7])
    d.extend(other, [1, 2, 3, 4])
    mine = d.add_path(PROMPT)
    d.extend(mine, [1, 2])
    assert tokens(d, mine, 2) == [3, 4]


def test_siblings_outrank_other_groups():
    d = ConsensusDrafter(DrafterOptions(min_prob=0.0, cross_group_weight=0.5))
    for _ in range(3):  # a popular continuation elsewhere
        p = d.add_path([7, 7, 7])
        d.extend(p, [1, 2, 3, 9])
    sib = d.add_path(PROMPT)
    d.extend(sib, [1, 2, 3, 5])
    mine = d.add_path(PROMPT)
    d.extend(mine, [1, 2, 3])
    assert tokens(d, mine, 1) == [5]


def test_draft_length_follows_confidence_and_cap():
    d = ConsensusDrafter(DrafterOptions(min_prob=0.3, cross_group_weight=0.0))
    paths = [d.add_path(PROMPT) for _ in range(3)]
    d.extend(paths[0], [1, 2, 3, 4, 5, 6])
    d.extend(paths[1], [1, 2, 3, 8, 8, 8])
    d.extend(paths[2], [1, 2])
    draft, probs = d.draft(paths[2], 8)
    # 3 is certain; after it the two siblings split 1:1: P = 0.5, then 0.5 * 1 ...
    assert draft[:2] == [3, 4] and probs[:2] == [1.0, 0.5]
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
    d = ConsensusDrafter(DrafterOptions(max_group_tokens=20_000, cross_group_tokens=20_000))
    vocab = list(range(50))

    def run_groups(n_groups):
        for g in range(n_groups):
            prompt = [1000 + g % 997, 2000 + g // 997] + rng.sample(vocab, 6)
            paths = [d.add_path(prompt) for _ in range(8)]
            for _ in range(4):
                for p in paths:
                    d.extend(p, [rng.choice(vocab) for _ in range(3)])
                    tokens(d, p, 4)

    run_groups(250)  # 2,000 paths: caches reach their budgets
    tracemalloc.start()
    run_groups(250)
    warm, _ = tracemalloc.get_traced_memory()
    nodes_warm = d.num_nodes()
    run_groups(1000)  # 8,000 more paths
    end, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert d.num_nodes() < 2 * nodes_warm
    assert end < warm + 4_000_000, (warm, end)
