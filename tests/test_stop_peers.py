"""The published stop rules (``adaptive``, ``esc``, ``consol``) against
transcriptions of their authors' code, on random answer sequences."""

from __future__ import annotations

import math
import random
from collections import Counter

from scipy import integrate

from consensus_spec.sampling.stopping import StopRule, should_stop, should_stop_ids, stop_answer
from evals.adaptive.stop_rules import replay_order


def random_answers(rng, n, classes):
    weights = [rng.random() ** 2 for _ in range(classes)]
    return [rng.choices(range(classes), weights)[0] for _ in range(n)]


def ac_published(answers, conf=0.95):
    """Adaptive-Consistency's BetaStoppingCriteria.should_stop (numerical integration)."""
    most = Counter(answers).most_common(2)
    a, b = float(most[0][1]), float(most[1][1]) if len(most) > 1 else 0.0
    prob = integrate.quad(lambda x: x ** a * (1 - x) ** b, 0.5, 1)[0] / \
        integrate.quad(lambda x: x ** a * (1 - x) ** b, 0, 1)[0]
    return prob >= conf


def esc_published(ids, window=5):
    """ESC's loop: non-overlapping windows; a window of one answer ends it
    with that answer, else the vote over every sample."""
    predicted = []
    for index in range(math.ceil(len(ids) / window)):
        batch = ids[index * window:(index + 1) * window]
        predicted += batch
        if len(set(batch)) == 1 and len(batch) == window:
            return len(predicted), batch[0]
    return len(predicted), Counter(predicted).most_common(1)[0][0]


def consol_published(ids, max_trials):
    """ConSol's ConfidentSolver.invoke with SprtConfidenceModel: samples in
    batches just large enough that the lead could reach the boundary."""
    p1, alpha, beta = 0.5001, 0.05, 1 - .05 - .000024
    log_a, log_b = math.log((1 - beta) / alpha), math.log(beta / (1 - alpha))

    def test(first, second):
        llr = first * math.log(p1 / 0.5) + second * math.log((1 - p1) / 0.5)
        return llr >= log_a or llr <= log_b

    used = 0
    while True:
        two = [c for _, c in Counter(ids[:used]).most_common(2)] + [0, 0]
        first, second = two[0], two[1]
        trials = 0
        for trials in range(0, max_trials + 1):
            if first + trials == 0:
                continue
            if test(first + trials, second):
                break
        trials = min(trials, max_trials - used)
        if trials == 0:
            return used
        used += trials


def test_adaptive_matches_the_published_beta_criterion():
    rng = random.Random(0)
    rule = StopRule(kind="adaptive")
    for _ in range(300):
        ids = random_answers(rng, rng.randint(1, 12), rng.randint(1, 4))
        assert should_stop_ids(ids, 5, rule) == ac_published(ids), ids
    # no "decided" shortcut, no minimum: it is the published rule alone
    assert not should_stop_ids([0, 0, 0], 1, rule) and should_stop_ids([0, 0, 0, 0], 30, rule)


def test_esc_matches_the_published_windows():
    rng = random.Random(1)
    rule = StopRule(kind="esc")
    every = lambda n: list(range(1, n))  # noqa: E731 - the rule holds its own windows
    for _ in range(300):
        n = rng.choice([8, 10, 16, 40])
        ids = random_answers(rng, n, rng.randint(1, 3))
        used, _, answer, _ = replay_order(ids, [1] * n, rule, every(n))
        assert (used, answer) == esc_published(ids), ids
    assert stop_answer([0, 1, 1, 1, 1, 1], rule) == 1  # the window's answer, not the vote's


def test_consol_matches_the_published_sprt():
    rng = random.Random(2)
    rule = StopRule(kind="consol")
    for _ in range(300):
        n = rng.choice([8, 16, 40])
        ids = random_answers(rng, n, rng.randint(1, 4))
        used = replay_order(ids, [1] * n, rule, list(range(1, n)))[0]
        assert used == consol_published(ids, n), ids
    assert should_stop(["7", "7", "7"], 5, kind="consol")  # a lead of 3
    assert not should_stop(["7", "7", "8", "7"], 5, kind="consol")
