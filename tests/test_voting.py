"""Equivalence-aware majority voting, weights, ties and best-of-n."""

from __future__ import annotations

import math
import random
import threading

import math_verify  # noqa: F401 - declared dependency: a missing one fails, never skips
import pytest

from consensus_spec.voting.equivalence import MathEngine  # noqa: E402
from consensus_spec.voting.vote import (  # noqa: E402
    best_of_n,
    cluster_answers,
    logprob_weights,
    majority_vote,
)


def timed(seconds, fn, *args, **kwargs):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("v", fn(*args, **kwargs)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"took longer than {seconds}s"
    return box["v"]


def test_equal_forms_form_one_class():
    r = majority_vote(["1/2", "0.5", r"\frac{1}{2}", r"\dfrac12", "3", None, "3", "x"])
    assert r.answer == "1/2"
    assert r.counts == {"1/2": 4, "3": 2, "x": 1}
    assert r.agreement == pytest.approx(4 / 7)
    assert r.assignment == [0, 0, 0, 0, 1, None, 1, 2]
    assert r.num_votes == 7 and r.num_abstained == 1
    assert r.winner.members == [0, 1, 2, 3]
    assert r.margin == 2


def test_symbolic_equivalence_merges_classes():
    r = majority_vote([r"\frac{\sqrt2}{2}", r"\frac{1}{\sqrt{2}}", "0.7071", "(x+1)^2"])
    assert r.counts[r"\frac{\sqrt2}{2}"] == 2  # 0.7071 is too coarse to join
    assert len(r.classes) == 3


def test_multiple_choice_letters():
    r = majority_vote(["B", "(B)", r"\text{(C)}", "b", "C", "B"])
    assert r.answer == "B"
    assert r.counts == {"B": 3, r"\text{(C)}": 2, "b": 1}  # lower-case b is a symbol


def test_tie_goes_to_earliest_first_occurrence():
    assert majority_vote(["7", "5", "5", "7"]).answer == "7"
    assert majority_vote(["5", "7", "7", "5"]).answer == "5"
    r = majority_vote(["A", "B"])
    assert r.answer == "A" and r.agreement == 0.5 and r.margin == 0


def test_weighted_tie_with_float_noise_is_still_a_tie():
    # 0.1 + 0.2 != 0.3 in floating point; must still count as a tie
    r = majority_vote(["2", "1", "1"], weights=[0.3, 0.1, 0.2])
    assert r.answer == "2"


def test_weights_can_flip_the_winner():
    answers = ["4", "4", "9"]
    assert majority_vote(answers).answer == "4"
    r = majority_vote(answers, weights=[0.1, 0.1, 0.5])
    assert r.answer == "9"
    assert r.agreement == pytest.approx(0.5 / 0.7)
    assert r.total_weight == pytest.approx(0.7)


def test_all_abstain_and_empty():
    for answers in ([], [None, None]):
        r = majority_vote(answers)
        assert r.answer is None and r.winner is None
        assert r.agreement == 0.0 and r.counts == {} and r.margin == 0.0
    assert majority_vote([None, None]).num_abstained == 2


def test_zero_total_weight():
    r = majority_vote(["1", "2"], weights=[0.0, 0.0])
    assert r.answer == "1" and r.agreement == 0.0


@pytest.mark.parametrize("weights", [[1.0], [1.0, -1.0], [1.0, float("nan")], [1.0, math.inf]])
def test_bad_weights_rejected(weights):
    with pytest.raises(ValueError):
        majority_vote(["1", "2"], weights=weights)


def test_cluster_ids_follow_first_appearance():
    ids = cluster_answers(["x", "2", "x", "0.5", "1/2", "2.0", None])
    assert ids == [0, 1, 0, 2, 2, 1, None]


def test_non_transitive_equality_is_deterministic():
    # math-verify: 50% ~ 50 and 50% ~ 0.5, but 50 !~ 0.5
    answers = ["50", r"50\%", "0.5", "50", "0.5"]
    first = majority_vote(answers)
    for _ in range(3):
        again = majority_vote(answers)
        assert again.assignment == first.assignment and again.answer == first.answer


def test_n64_is_fast_and_parses_once_per_distinct_answer(monkeypatch):
    rng = random.Random(0)
    answers = [rng.choice(["12", "12.0", r"\frac{24}{2}", "13", "x^2+1", None, r"\sqrt{144}"])
               for _ in range(64)]
    answers += [f"x^{{{i}}}+{i % 7}" for i in range(20)]  # many distinct symbolic classes
    r = timed(120, majority_vote, answers)
    twelve = ("12", "12.0", r"\frac{24}{2}", r"\sqrt{144}")
    assert r.winner.answer in twelve
    assert r.winner.members == [i for i, a in enumerate(answers) if a in twelve]
    assert len(r.classes) == 3 + 20  # 12, 13, x^2+1 and the 20 distinct ones
    # parses and verdicts are cached now: a second vote asks the sympy worker nothing
    calls = []
    real = MathEngine._call
    monkeypatch.setattr(MathEngine, "_call",
                       lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
    again = timed(60, majority_vote, answers)
    assert calls == [] and again.assignment == r.assignment


def test_vote_from_worker_thread():
    r = timed(60, majority_vote, ["0.25", "1/4", "3"])
    assert r.answer == "0.25" and r.counts["0.25"] == 2


def test_garbage_answers_vote_without_hanging():
    junk = ["{" * 3000, "\\" * 4000, "9" * 4000, "}" * 10, "", " ", "{" * 200 + "}" * 200]
    r = timed(60, majority_vote, junk + ["7", "7"])
    assert r.answer == "7"
    assert r.num_abstained == 2  # blank answers do not vote


# ---------------------------------------------------------------------------
# Weights and best-of-n
# ---------------------------------------------------------------------------


def test_logprob_weights_exp_mean():
    w = logprob_weights([0.0, math.log(0.5), -math.inf])
    assert w == pytest.approx([1.0, 0.5, 0.0])
    assert logprob_weights([math.log(0.25)], temperature=2.0) == pytest.approx([0.5])


def test_logprob_weights_softmax():
    w = logprob_weights([math.log(1), math.log(3)], method="softmax")
    assert w == pytest.approx([0.25, 0.75])
    assert sum(logprob_weights([-1000.0, -1001.0, -999.0], "softmax")) == pytest.approx(1.0)
    assert logprob_weights([-math.inf, -math.inf], "softmax") == [0.0, 0.0]


@pytest.mark.parametrize("bad", [[None], [float("nan")]])
def test_logprob_weights_reject_missing(bad):
    with pytest.raises(ValueError):
        logprob_weights(bad)


def test_logprob_weights_bad_args():
    with pytest.raises(ValueError):
        logprob_weights([0.0], method="nope")
    with pytest.raises(ValueError):
        logprob_weights([0.0], temperature=0)


def test_best_of_n_picks_highest_mean_logprob():
    samples = [
        {"answer": "1", "mean_logprob": -0.9, "cumulative_logprob": -9.0},
        {"answer": "2", "mean_logprob": -0.2, "cumulative_logprob": -20.0},
        {"answer": None, "mean_logprob": -0.01, "cumulative_logprob": -0.1},
        {"answer": "3", "mean_logprob": None, "cumulative_logprob": None},
    ]
    best = best_of_n(samples)
    assert best.index == 1 and best.score == -0.2 and best.sample["answer"] == "2"
    assert best_of_n(samples, "cumulative_logprob").index == 0
    assert best_of_n(samples, require_answer=False).index == 2
    assert best_of_n(samples, lambda s: len(s["answer"] or "")).index == 0  # tie -> earliest


def test_best_of_n_attribute_access_and_empty():
    class S:
        def __init__(self, answer, lp):
            self.answer, self.mean_logprob = answer, lp

    assert best_of_n([S("a", -1.0), S("b", -0.5)]).sample.answer == "b"
    assert best_of_n([]) is None
    assert best_of_n([S("a", None)]) is None
    assert best_of_n([S(None, -1.0)]).index == 0  # no sample has an answer: still scored
