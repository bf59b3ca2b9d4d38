"""Adaptive stopping rules (consensus_spec.sampling.stopping) and their replay eval (evals.stopping)."""

from __future__ import annotations

import json
import os
import random

import pytest

pytest.importorskip("scipy")

from consensus_spec.sampling.engine_loop import should_stop as engine_should_stop  # noqa: E402
from consensus_spec.sampling.stopping import (  # noqa: E402
    StopRule,
    _flip_probability,
    should_stop,
    should_stop_ids,
    tally,
)
from consensus_spec.voting.vote import majority_vote  # noqa: E402
from evals.stopping import (  # noqa: E402
    VoteTrace,
    checkpoints,
    evaluate,
    load_vote_traces,
    parse_waves,
    replay_order,
)
from evals.stopping import main as stopping_main  # noqa: E402

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data")


def random_ids(rng, n, classes=3, none_rate=0.1):
    weights = [rng.random() for _ in range(classes)]
    return [None if rng.random() < none_rate else rng.choices(range(classes), weights)[0]
            for _ in range(n)]


def first_stop(answers, n, **rule):
    """Samples consumed before the rule stops (n if it never does)."""
    for k in range(1, n):
        if should_stop(answers[:k], n - k, **rule):
            return k
    return n


# --- rules -----------------------------------------------------------------

def test_decided_never_disagrees_with_full_n():
    rng = random.Random(0)
    rule = StopRule(kind="decided")
    for _ in range(500):
        n = rng.randint(1, 12)
        ids = random_ids(rng, n, classes=rng.randint(1, 4))
        used, _, stopped, full = replay_order(ids, [1] * n, rule, checkpoints(n, None))
        assert stopped == full
        if used < n:  # it stopped, so the lead really exceeded what was left
            ranked = tally(ids[:used])
            assert ranked[0][1] - (ranked[1][1] if len(ranked) > 1 else 0) > n - used


def test_decided_matches_the_engine_rule_on_answers():
    rng = random.Random(1)
    pool = ["1/2", "0.5", "3", "x", None]
    for _ in range(200):
        answers = [rng.choice(pool) for _ in range(rng.randint(1, 8))]
        remaining = rng.randint(0, 6)
        expect = remaining > 0 and engine_should_stop(majority_vote(answers), remaining)
        assert should_stop(answers, remaining, kind="decided") == expect


def test_equivalent_answers_vote_together():
    # 1/2, 0.5 and \frac{1}{2} are one class: lead 3 > 2 remaining
    assert should_stop(["1/2", "0.5", r"\frac{1}{2}"], 2, kind="decided")
    assert not should_stop(["1/2", "0.5", "7"], 2, kind="decided")


def test_statistical_rules_stop_earlier_on_unanimous_answers_than_decided():
    n = 8
    answers = ["42"] * n
    decided = first_stop(answers, n, kind="decided")
    assert decided == 5  # lead 5 > 3 remaining
    assert first_stop(answers, n, kind="beta", error=0.05) == 4  # 1 - 0.5**5 >= 0.95
    assert first_stop(answers, n, kind="beta", error=0.1, min_samples=2) == 3
    assert first_stop(answers, n, kind="predictive", error=0.05) == 3
    assert first_stop(answers, n, kind="window", window=4) == 4
    # min_samples holds a statistical rule back, but never the exact one
    assert first_stop(answers, n, kind="beta", error=0.1, min_samples=4) == 4
    assert should_stop(["42"] * 3, 2, kind="beta", min_samples=10)


def test_split_votes_keep_sampling():
    answers = ["1", "2", "1", "2", "1", "2"]
    for kind in ("beta", "predictive", "window", "margin"):
        assert not should_stop(answers, 10, kind=kind)


def test_window_semantics():
    rule = StopRule(kind="window", window=3)
    assert should_stop_ids([1, 0, 0, 0], 10, rule)
    assert not should_stop_ids([0, 0], 10, rule)  # fewer than `window` answers
    assert not should_stop_ids([0, None, 0, 0], 10, rule)  # a missing answer breaks the run
    assert not should_stop_ids([0, 1, 0, 0], 10, rule)
    # the run must belong to the leader: 4 zeros still beat 3 ones
    assert not should_stop_ids([0, 0, 0, 0, 1, 1, 1], 10, rule)
    assert should_stop_ids([0, 0, 0, 1, 1, 1, 1], 10, rule)  # 4-3: ones lead, and ran 3 in a row


def test_none_answers():
    for kind in ("decided", "beta", "predictive", "window", "margin"):
        assert not should_stop([None] * 5, 3, kind=kind)
        assert not should_stop([], 3, kind=kind)
    # Nones do not count as votes towards min_samples
    assert not should_stop_ids([None, None, 0, 0], 20, StopRule(kind="margin", margin=2, min_samples=3))
    assert should_stop_ids([None, 0, 0, 0], 20, StopRule(kind="margin", margin=2, min_samples=3))
    assert should_stop(["7", None, "7", None, "7", "7", "7"], 1, kind="decided")


def test_nothing_remaining_means_nothing_to_stop():
    for kind in ("decided", "beta", "predictive", "window", "margin"):
        assert not should_stop(["5"] * 8, 0, kind=kind)
        assert not should_stop_ids([0] * 8, 0, StopRule(kind=kind))


def test_predictive_flip_probability():
    # one vote, one path left: flips (ties count) iff it opens a new class; E[p_new] = 1/3
    assert _flip_probability((1,), 0, 1) == pytest.approx(1 / 3)
    assert _flip_probability((5,), 0, 3) == 0.0  # cannot catch up
    # more agreement, or fewer paths left, lowers the risk
    assert _flip_probability((4,), 0, 20) < _flip_probability((3,), 0, 20)
    assert _flip_probability((3,), 0, 5) < _flip_probability((3,), 0, 30)
    assert _flip_probability((3, 2), 0, 10) > _flip_probability((3,), 1, 10)
    assert 0.0 <= _flip_probability((1, 1, 1), 2, 30) <= 1.0


def test_validation_errors():
    for bad in ({"kind": "nope"}, {"error": 0.0}, {"error": 1.0}, {"error": True},
                {"min_samples": 0}, {"min_samples": 2.5}, {"window": 1}, {"margin": 0}):
        with pytest.raises(ValueError):
            StopRule(**bad)
    with pytest.raises(ValueError, match="unknown StopRule field"):
        should_stop(["1"], 3, windw=4)
    with pytest.raises(ValueError, match="remaining"):
        should_stop(["1"], -1)
    with pytest.raises(ValueError, match="remaining"):
        should_stop_ids([0], 1.5)


def test_describe_and_default():
    assert StopRule(kind="decided").describe() == "decided"
    assert StopRule(kind="window", window=5).describe() == "window(5)"
    assert StopRule(kind="beta", error=0.05, min_samples=3).describe() == "beta(error=0.05, min=3)"
    assert StopRule(kind="margin", margin=2, min_samples=2).describe() == "margin(margin=2, min=2)"
    assert StopRule().kind == "predictive"  # chosen by `python -m evals stopping`


# --- replay eval -----------------------------------------------------------

def test_checkpoints_and_waves():
    assert checkpoints(4, None) == [1, 2, 3]
    waves = parse_waves(["1", "2", "4", "rest"])
    assert waves == [1, 2, 4, None]
    assert checkpoints(40, waves) == [1, 3, 7]
    assert checkpoints(5, waves) == [1, 3]  # the 4-wave is cut to what is left
    assert checkpoints(10, parse_waves(["3"])) == [3, 6, 9]  # last size repeats
    for bad in (["rest", "2"], ["0"], ["x"]):
        with pytest.raises(ValueError):
            parse_waves(bad)


def test_replay_counts_samples_and_tokens():
    ids = [0, 0, 0, 1, 0, 0]
    tokens = [10, 20, 30, 40, 50, 60]
    rule = StopRule(kind="window", window=3)
    assert replay_order(ids, tokens, rule, checkpoints(6, None)) == (3, 60, 0, 0)
    # waves 2, then the rest: the rule only looks after whole waves
    assert replay_order(ids, tokens, rule, checkpoints(6, [2, None])) == (6, 210, 0, 0)
    # after 4 the last three are 0, 0, 1: no run, so the second wave runs to the end
    assert replay_order(ids, tokens, rule, checkpoints(6, [4, None])) == (6, 210, 0, 0)


def test_evaluate_on_tiny_traces():
    traces = [
        VoteTrace("easy", [0] * 8, [5] * 8, correct=[True]),
        VoteTrace("split", [0, 1, 0, 1, 1, 0, 1, 2], [10] * 8, correct=[False, True, False]),
        VoteTrace("blank", [None] * 8, [1] * 8, correct=[]),
    ]
    rules = [StopRule(kind="decided"), StopRule(kind="beta", error=0.1, min_samples=2)]
    out = evaluate(traces, rules, perms=3, seed=0)
    decided, beta = out["decided"], out["beta(error=0.1, min=2)"]
    assert decided["agreement"] == 1.0 and decided["agreement_perm_worst"] == 1.0
    assert decided["gold_acc"] == decided["gold_acc_full"] == pytest.approx(2 / 3)
    assert traces[1].share == 0.5 and decided["hard_agreement"] == 1.0  # "split" is hard
    assert beta["samples_per_problem"] < decided["samples_per_problem"]
    assert beta["tokens_frac"] < decided["tokens_frac"] <= 1.0
    assert set(beta["shortest_first"]) >= {"agreement", "tokens_frac"}


def test_load_vote_traces(tmp_path):
    class CharTokenizer:
        class _Enc:
            def __init__(self, ids):
                self.ids = ids

        def encode_batch(self, texts):
            return [self._Enc(list(t)) for t in texts]

    path = tmp_path / "t.jsonl"
    rows = [{"id": "a", "prompt": "Q", "answer": "0.5",
             "completions": ["The answer is 1/2.", "so \\boxed{0.5}", "The answer is 3.", "no idea"]},
            {"id": "b", "prompt": "Q", "completions": ["only one"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    (t,) = load_vote_traces(str(path), CharTokenizer())
    assert t.id == "a" and t.ids == [0, 0, 1, None]
    assert t.tokens == [len("The answer is 1/2.") + 1, len("so \\boxed{0.5}") + 1, 17, 8]
    assert t.correct == [True, False]


def test_shared_traces_end_to_end(tmp_path):
    if not os.path.isdir(SHARED):
        pytest.skip(f"shared data not found at {os.path.normpath(SHARED)}")
    pytest.importorskip("tokenizers")
    out = tmp_path / "stopping.json"
    assert stopping_main(["--limit", "15", "--perms", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["sets"]) == {"gsm8k_qwen3_4b_n8", "addsub_codex002_n40"}
    assert "svamp_pot_codex002_n30" in data["skipped"]
    for s in data["sets"].values():
        assert s["rules"]["decided"]["agreement"] == 1.0
        assert s["rules"]["decided"]["agreement_perm_worst"] == 1.0
    assert data["default"] in data["selection"]
    assert os.path.exists(tmp_path / "stopping.md")
