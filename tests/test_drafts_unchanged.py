"""Faster is all issue 43 changed: the proposer drafts, step for step, what
the code before it drafted (a digest per propose() call, recorded with that
code: tests/draft_fixture.py), and one compiled call per step drafts what
drafting each path on its own does."""

import json
import os

import numpy as np
import pytest

import consensus_spec
from consensus_spec import ConsensusDrafter, DrafterOptions
from tests import draft_fixture

RECORDED = os.path.join(draft_fixture.FIXTURES, "drafts_287c905.json")


@pytest.fixture(scope="module")
def recorded():
    with open(RECORDED, encoding="utf-8") as f:
        data = json.load(f)
    assert data["k"] == draft_fixture.K
    assert data["configs"] == {n: list(c) for n, c in draft_fixture.CONFIGS.items()}
    return data["digests"]


@pytest.mark.parametrize("name", list(draft_fixture.CONFIGS))
def test_proposer_drafts_what_the_previous_code_drafted(name, recorded):
    counters = {}
    now = draft_fixture.drive(consensus_spec, *draft_fixture.CONFIGS[name], counters=counters)
    before = recorded[name]
    first = next((i for i, (a, b) in enumerate(zip(now, before)) if a != b), None)
    assert first is None and len(now) == len(before), (
        f"{name}: drafts differ from call {first} on "
        f"({len(now)} calls now, {len(before)} recorded)")
    assert counters["num_drafted"] > 1000 and counters["num_accepted"] > 1000
    # each configuration reaches what it is there for
    if name == "rows16_preempt_skip":
        assert counters["paths_resumed"] > 0 and counters["tokens_missed"] > 0
    if name == "rows16_small_arena":
        assert counters["evictions"] > 3
    if name.endswith("_budget"):
        assert counters["steps_timed"] > 100 and counters["explore_pct"] > 0


def test_one_call_drafts_what_each_path_drafts_alone():
    """Siblings at the same context share one walk in extend_and_draft;
    each row must still get exactly its own draft, cut to its own limit
    (limits differ, so a shared walk is sometimes too short and redone)."""
    rng = np.random.default_rng(0)
    d = ConsensusDrafter(DrafterOptions(min_prob=0.01, prior=0.5, max_depth=6))
    prompts = [[1, 2, 3], [4, 5]]
    paths = [d.add_path(prompts[i % 2]) for i in range(12)]
    text = {p: [] for p in paths}
    width = 64
    for step in range(120):
        # each group's paths mostly write the same chunk: siblings often share a context
        chunks = [[int(t) for t in rng.integers(7, 12, int(rng.integers(1, 3)))] for _ in prompts]
        new = [chunks[i % 2] if rng.random() < 0.85 else [int(rng.integers(20, 26))]
               for i in range(len(paths))]
        buf = np.zeros((len(paths), width), np.int32)
        for i, toks in enumerate(new):
            buf[i, :len(toks)] = toks
            text[paths[i]] += toks
        limits = rng.integers(-1, 7, len(paths))  # < 0: a row with no room left
        ends = np.array([len(t) for t in new])
        toks, probs, lens = (a.copy() for a in d.extend_and_draft(
            paths, buf, np.arange(len(paths)), np.zeros(len(paths), np.int64), ends, limits))
        assert toks.shape == probs.shape == (len(paths), limits.max())
        for i, p in enumerate(paths):
            t1, p1, l1 = d.draft([p], [limits[i]])
            n = int(l1[0])
            assert lens[i] == n and np.array_equal(toks[i, :n], t1[0, :n])
            assert np.array_equal(probs[i, :n], p1[0, :n])
            assert not toks[i, n:].any() and not probs[i, n:].any()
    assert sum(len(t) for t in text.values()) > 1500
