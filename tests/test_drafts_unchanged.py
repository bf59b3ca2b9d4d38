"""Faster is all issues 43 and 50 changed: the proposer drafts, step for
step, what the code before them drafted (a digest per propose() call,
recorded with that code: tests/draft_fixture.py), on the first fixture and
on the long-prompt workloads of issue 50 (prompts of 250-476 tokens with
short answers, n=64), and one compiled call per step drafts what drafting
each path on its own does."""

import json
import os

import numpy as np
import pytest

import consensus_spec
from consensus_spec import ConsensusDrafter, DrafterOptions
from tests import draft_fixture

RECORDED = {"drafts_2df8630.json": draft_fixture.CONFIGS,
            "drafts_440a09e.json": draft_fixture.LONG_PROMPT_CONFIGS}


@pytest.fixture(scope="module")
def recorded():
    digests = {}
    for name, configs in RECORDED.items():
        with open(os.path.join(draft_fixture.FIXTURES, name), encoding="utf-8") as f:
            data = json.load(f)
        assert data["k"] == draft_fixture.K
        assert data["configs"] == {n: list(c) for n, c in configs.items()}
        digests.update(data["digests"])
    return digests


@pytest.mark.parametrize("name", [*draft_fixture.CONFIGS, *draft_fixture.LONG_PROMPT_CONFIGS])
def test_proposer_drafts_what_the_previous_code_drafted(name, recorded):
    counters = {}
    now = draft_fixture.drive_config(consensus_spec, name, counters=counters)
    before = recorded[name]
    first = next((i for i, (a, b) in enumerate(zip(now, before)) if a != b), None)
    assert first is None and len(now) == len(before), (
        f"{name}: drafts differ from call {first} on "
        f"({len(now)} calls now, {len(before)} recorded)")
    first_fixture = name in draft_fixture.CONFIGS
    # the long-prompt fixtures are smaller, and their budget drafts little (it
    # reaches 264-7,200 drafted tokens and 113-3,050 accepted)
    least = 1000 if first_fixture else 100
    assert counters["num_drafted"] > least and counters["num_accepted"] > least
    # each configuration reaches what it is there for
    if "preempt" in name:
        assert counters["paths_resumed"] > 0 and counters["tokens_missed"] > 0
    if name == "rows16_small_arena":
        assert counters["evictions"] > 3
    if name.endswith("_small_arena") and not first_fixture:  # rotations under prompt builds
        assert counters["evictions"] >= 3
    if name == "fewshot_rows32_small_arena":  # groups forgotten while their paths run
        assert counters["num_groups"] <= 2
    if name.startswith("long64"):
        assert counters["paths_started"] >= 128
    if name.endswith("_budget"):
        assert counters["steps_timed"] > (100 if first_fixture else 50)
        if first_fixture:  # the long-prompt budget runs are too short to explore (0%)
            assert counters["explore_pct"] > 0
    if name == "rows3_budget":  # walks stopped at a raised floor, some walked again: the same drafts
        assert counters["floor_raised_steps"] > 50 and counters["walked_again"] > 0, counters


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
