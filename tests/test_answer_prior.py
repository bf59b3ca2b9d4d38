"""The answer prior behind the default stop rule (``bayes``): its flip
probability against simulation, learning a run's difficulty, its bounds."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from consensus_spec import AnswerPrior, StopRule, should_stop
from consensus_spec.sampling import answer_prior
from consensus_spec.sampling.stopping import should_stop_ids

EASY, HARD = (0.95, 0.03), (0.5, 0.4)  # (leader's share, runner-up's); the rest scattered


def problem(rng, shares, n):
    """n answers: class 0 and 1 with ``shares``, every other path an answer of its own."""
    out, fresh = [], 2
    for _ in range(n):
        u = rng.random()
        if u < shares[0]:
            out.append(0)
        elif u < shares[0] + shares[1]:
            out.append(1)
        else:
            out.append(fresh)
            fresh += 1
    return out


def votes(ids):
    return list(Counter(ids).values()), 0


def test_the_flip_probability_matches_simulation():
    """Problems drawn from a known mix (70% easy, 30% hard): the prior fitted
    on their whole votes predicts how often a vote seen after k paths flips."""
    rng = random.Random(0)
    n = 16
    draws = [problem(rng, EASY if rng.random() < 0.7 else HARD, n) for _ in range(3000)]
    prior = AnswerPrior.fit([votes(d) for d in draws])
    seen: dict = {}
    for ids in draws:
        full = Counter(ids)
        top = max(full.values())
        for k in (3, 5):
            head = Counter(ids[:k]).most_common()
            lead, second = head[0][1], head[1][1] if len(head) > 1 else 0
            state = (lead, second, k - lead - second, n - k)
            flipped = any(c > full[head[0][0]] for c in full.values()) and full[head[0][0]] < top
            total, flips = seen.get(state, (0, 0))
            seen[state] = (total + 1, flips + flipped)
    checked = 0
    for state, (total, flips) in seen.items():
        if total < 400:
            continue
        want = flips / total
        got = prior.flip_probability(*state)
        assert abs(got - want) < 0.03 + 0.25 * want, (state, got, want, total)
        checked += 1
    assert checked >= 3


def test_flip_probability_moves_the_right_way():
    prior = AnswerPrior.default()
    assert prior.flip_probability(4, 0, 0, 4) == 0.0  # the runner-up can at best draw level
    assert prior.flip_probability(3, 0, 0, 13) < prior.flip_probability(2, 0, 0, 14)
    assert prior.flip_probability(3, 0, 0, 5) < prior.flip_probability(3, 0, 0, 30)
    assert prior.flip_probability(3, 2, 0, 10) > prior.flip_probability(3, 1, 1, 10)
    assert 0.3 < prior.flip_probability(2, 2, 0, 10) <= 1.0
    for bad in ((1, 2, 0, 3), (1, 0, -1, 3), (1, 0, 0, -1)):
        with pytest.raises(ValueError):
            prior.flip_probability(*bad)


def test_a_run_learns_how_hard_its_problems_are():
    rng = random.Random(1)
    before = AnswerPrior.learning().flip_probability(3, 0, 0, 13)
    for shares, direction in ((HARD, 1), (EASY, -1)):
        prior = AnswerPrior.learning()
        for _ in range(200):
            ids = problem(rng, shares, 16)
            prior.observe(*votes(ids), length=50.0)
        after = prior.flip_probability(3, 0, 0, 13)
        assert (after - before) * direction > 0, (shares, before, after)
        assert prior.problems_seen == 200
    static = AnswerPrior.default()
    static.observe([3, 1], 0)  # a prior that does not learn ignores what it is shown
    assert static.problems_seen == 0


def test_path_length_marks_hard_problems_once_the_run_has_taught_it():
    """Hard problems with long paths, easy ones with short: the learned prior
    is more careful about a long problem than a short one in the same state."""
    rng = random.Random(2)
    prior = AnswerPrior.learning()
    for _ in range(400):
        hard = rng.random() < 0.5
        ids = problem(rng, HARD if hard else EASY, 16)
        prior.observe(*votes(ids), length=rng.uniform(300, 400) if hard else rng.uniform(50, 100))
    long_, short = prior.flip_probability(3, 0, 0, 13, 350.0), prior.flip_probability(3, 0, 0, 13, 70.0)
    assert long_ > 2 * short
    rule = StopRule(error=max(short, 1e-6) * 1.5)
    assert should_stop_ids([0, 0, 0], 13, rule, prior=prior, length=70.0)
    assert not should_stop_ids([0, 0, 0], 13, rule, prior=prior, length=350.0)
    assert should_stop(["7", "7", "7"], 13, rule, prior=prior, lengths=[60, 70, 80])
    with pytest.raises(ValueError, match="lengths"):
        should_stop(["7", "7"], 13, rule, prior=prior, lengths=[60])


def test_memory_is_bounded_and_json_round_trips(monkeypatch, tmp_path):
    monkeypatch.setattr(answer_prior, "MAX_PROBLEMS", 50)
    prior = AnswerPrior.learning()
    for i in range(120):
        prior.observe([1 + i % 7, 1], 1, length=float(i))
    assert prior.problems_seen == 50
    path = tmp_path / "prior.json"
    path.write_text(json.dumps(AnswerPrior.default().to_json()))
    again = AnswerPrior.from_json(json.loads(path.read_text()))
    assert again.flip_probability(2, 0, 0, 6) == pytest.approx(AnswerPrior.default().flip_probability(2, 0, 0, 6))
    for bad in ({"grid_step": 0.1}, {"grid_step": answer_prior.GRID_STEP, "components": [[1.0, 2.0]]}):
        with pytest.raises(ValueError):
            AnswerPrior.from_json(bad)
    with pytest.raises(ValueError):
        prior.observe([-1], 0)
    with pytest.raises(ValueError):
        prior.observe([1], 0, length=-3)
    with pytest.raises(ValueError, match="at least one problem"):
        AnswerPrior.fit([])
