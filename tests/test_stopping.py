"""Adaptive stopping rules (consensus_spec.sampling.stopping) and their replay eval,
through its command line (`python -m evals stop-rules`) on trace files the tests write."""

from __future__ import annotations

import json
import os
import random

import pytest

import scipy  # noqa: F401,E402 - declared dependency: a missing one fails, never skips

from consensus_spec.sampling.options import vote_is_settled  # noqa: E402
from consensus_spec.sampling.stopping import (  # noqa: E402
    StopRule,
    _flip_probability,
    should_stop,
    should_stop_ids,
    tally,
)
from consensus_spec.voting.vote import majority_vote  # noqa: E402
from tests.evals_cli import EOS, TRACES, char_tokenizer, ok, read_json, run_evals  # noqa: E402


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

def replay_ids(ids, rule, looks):
    """(samples used, stopped winner, full-N winner): ``ids`` fed to ``rule`` in
    order, checked after each count in ``looks``."""
    used = next((k for k in looks if should_stop_ids(ids[:k], len(ids) - k, rule)), len(ids))

    def winner(ranked):
        return ranked[0][0] if ranked else None

    return used, winner(tally(ids[:used])), winner(tally(ids))


def test_decided_never_disagrees_with_full_n():
    rng = random.Random(0)
    rule = StopRule(kind="decided")
    for _ in range(500):
        n = rng.randint(1, 12)
        ids = random_ids(rng, n, classes=rng.randint(1, 4))
        used, stopped, full = replay_ids(ids, rule, range(1, n))
        assert stopped == full
        if used < n:  # it stopped, so the lead really exceeded what was left
            ranked = tally(ids[:used])
            assert ranked[0][1] - (ranked[1][1] if len(ranked) > 1 else 0) > n - used
    # the replay command agrees: on random sets, in every order (test_replay_on_tiny_traces)


def test_decided_matches_the_engine_rule_on_answers():
    rng = random.Random(1)
    pool = ["1/2", "0.5", "3", "x", None]
    for _ in range(200):
        answers = [rng.choice(pool) for _ in range(rng.randint(1, 8))]
        remaining = rng.randint(0, 6)
        expect = remaining > 0 and vote_is_settled(majority_vote(answers), remaining)
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
    for kind in ("sequential", "beta", "predictive", "window", "margin"):
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
    for kind in ("decided", "sequential", "beta", "predictive", "window", "margin"):
        assert not should_stop([None] * 5, 3, kind=kind)
        assert not should_stop([], 3, kind=kind)
    # Nones do not count as votes towards min_samples
    assert not should_stop_ids([None, None, 0, 0], 20, StopRule(kind="margin", margin=2, min_samples=3))
    assert should_stop_ids([None, 0, 0, 0], 20, StopRule(kind="margin", margin=2, min_samples=3))
    assert should_stop(["7", None, "7", None, "7", "7", "7"], 1, kind="decided")


def test_nothing_remaining_means_nothing_to_stop():
    for kind in ("decided", "sequential", "beta", "predictive", "window", "margin"):
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
    assert StopRule().kind == "bayes"  # chosen by leave-one-set-out in `python -m evals stop-rules`
    assert StopRule().describe() == "bayes(error=0.002)" and StopRule().min_samples == 1
    assert StopRule(kind="sequential", error=0.05).describe() == "sequential(error=0.05, min=3)"
    assert StopRule(kind="sequential").error == 0.2 and StopRule(kind="window").window == 4
    # the peers at their published settings
    assert StopRule(kind="adaptive").describe() == "adaptive(error=0.05)"
    assert StopRule(kind="esc").describe() == "esc(5)" and StopRule(kind="consol").describe() == "consol"
    assert StopRule(kind="margin").error is None  # no stated error
    # switching kind takes the new kind's defaults, not the old one's
    assert StopRule().with_overrides(kind="sequential").error == 0.2


# --- replay eval -----------------------------------------------------------

def answer_text(i):
    """A completion voting for class ``i`` (None: one without an answer)."""
    return "no idea" if i is None else f"The answer is {5 + i}."


def write_votes(path, problems):
    """A trace file of ``problems``: ``[(id, class ids, tokens, gold class), ...]``;
    each completion names its class's answer (``answer_text``) and has
    ``tokens`` recorded ids (EOS last); gold None: no gold answer."""
    with open(path, "w", encoding="utf-8") as f:
        for pid, ids, tokens, gold in problems:
            obj = {"id": pid, "prompt": f"problem {pid}", "completions": [answer_text(i) for i in ids],
                   "completion_ids": [[7] * (t - 1) + [EOS] for t in tokens]}
            if gold is not None:
                obj["answer"] = str(5 + gold)
            f.write(json.dumps(obj) + "\n")
    return str(path)


def stop_rules(tmp, name, traces, *extra):
    """``python -m evals stop-rules`` on ``traces`` (char tokenizer); its JSON."""
    out = tmp / f"{name}.json"
    ok(run_evals("stop-rules", "--traces", *traces, "--tokenizer", char_tokenizer(tmp / "chars.json"),
                 "--out", out, *extra))
    return read_json(out)


WINDOW = [("w", [0, 0, 0, 1, 0, 0], [10, 20, 30, 40, 50, 60], 0)]
PROGRAMS = {"price = 76\ndiscount = 25\nans = price - discount": "51", "ans = 7 / 2": "3.5",
            "a = 0.1\nans = a + 0.2": "0.3",  # decimal literals, exact
            "x = 9\nans = -x // 2 % 7 + 2 ** 3": "10",  # Python semantics
            "ans = 1 / 3": "0.3333333333"}
NOT_FOLDED = ("import os\nans = 1", "ans = len('ab')", "ans = __import__('os').getcwd()",
              "ans = (1).real", "ans = 2 ** 10 ** 9", "ans = 1 / 0", "ans = True",
              "ans = 3, 4", "x = 1", "ans = y + 1", "ans = 1 if 2 > 1 else 0",
              "while True:\n    pass", "ans = 5\nprint(ans)", "ans = ",
              "ans = " + "(" * 500 + "1" + ")" * 500, "ans = 10 ** 40")


@pytest.fixture(scope="module")
def every_path(tmp_path_factory):
    """One run, rules checked after every path (--waves 1), 3 random orders, per-problem
    figures; sets: tiny (easy / split / blank), votes (answers extracted from text,
    char tokens), window, random (150 random problems) and tiny_pot_set (programs)."""
    tmp = tmp_path_factory.mktemp("every_path")
    tiny = write_votes(tmp / "tiny.jsonl", [("easy", [0] * 8, [5] * 8, 0),
                                            ("split", [0, 1, 0, 1, 1, 0, 1, 2], [10] * 8, 1),
                                            ("blank", [None] * 8, [1] * 8, 0)])
    votes = tmp / "votes.jsonl"
    rows = [{"id": "a", "prompt": "Q", "answer": "0.5",
             "completions": ["The answer is 1/2.", "so \\boxed{0.5}", "The answer is 3.", "no idea"]},
            {"id": "b", "prompt": "Q", "completions": ["only one"]}]
    votes.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    rng = random.Random(0)
    problems = []
    for p in range(150):
        n = rng.randint(2, 12)
        problems.append((f"r{p}", random_ids(rng, n, classes=rng.randint(1, 4)), [3] * n, None))
    rand = write_votes(tmp / "random.jsonl", problems)
    pot = tmp / "tiny_pot_set.jsonl"  # *_pot_*: answers are folded from the program text
    pot.write_text(json.dumps({"id": "pot", "prompt": "Q", "completions": [*PROGRAMS, *NOT_FOLDED]}) + "\n")
    return stop_rules(tmp, "every_path", [tiny, votes, write_votes(tmp / "window.jsonl", WINDOW), rand, pot],
                      "--waves", "1", "--perms", "3", "--seed", "0", "--per-problem", "--skip-bad-lines")


def test_evaluate_on_tiny_traces(every_path):
    s = every_path["sets"]["tiny"]
    decided, beta = s["rules"]["decided"], s["rules"]["beta(error=0.05, min=3)"]
    assert decided["agreement"] == 1.0 and decided["agreement_perm_worst"] == 1.0
    assert decided["gold_acc"] == decided["gold_acc_full"] == pytest.approx(2 / 3)
    split = next(p for p in s["per_problem"] if p["id"] == "split")
    assert split["share"] == 0.5 and s["hard_problems"] == 1 and decided["hard_agreement"] == 1.0  # hard
    assert beta["samples_per_problem"] < decided["samples_per_problem"]
    assert beta["tokens_frac"] < decided["tokens_frac"] <= 1.0
    assert set(beta["shortest_first"]) >= {"agreement", "tokens_frac"}
    assert s["full_tokens"] == 8 * (5 + 10 + 1)


def test_answer_wait_is_the_longest_path_voted_on(every_path):
    # window: answers 0,0,0,1,0,0 of 10..60 tokens; decided stops after 5 paths (4-1 > 1 left),
    # so alone with every path at once the answer waits for the 50-token path of 60
    r = every_path["sets"]["window"]["rules"]["decided"]
    assert r["samples_per_problem"] == 5
    assert r["answer_wait_frac"] == pytest.approx(50 / 60)
    assert r["shortest_first"]["answer_wait_frac"] == pytest.approx(50 / 60)  # already shortest first
    easy = every_path["sets"]["tiny"]["rules"]["decided"]  # equal lengths: no stop can answer sooner
    assert easy["answer_wait_frac"] == 1.0


def test_decided_agrees_with_full_n_on_random_sets(every_path):
    r = every_path["sets"]["random"]["rules"]["decided"]
    assert r["agreement"] == r["agreement_perm_worst"] == r["shortest_first"]["agreement"] == 1.0
    assert r["samples_frac"] < 1.0  # and it does stop early


def test_load_vote_traces(every_path):
    s = every_path["sets"]["votes"]
    assert s["problems"] == 1  # "b" has one completion; the broken line is skipped (--skip-bad-lines)
    (t,) = s["per_problem"]
    assert t["id"] == "a" and t["ids"] == [0, 0, 1, None]
    assert t["answers"][3] is None
    assert t["tokens"] == [len("The answer is 1/2.") + 1, len("so \\boxed{0.5}") + 1, 17, 8]
    assert t["correct"] == [True, False]


def test_program_answer_folds_straight_line_arithmetic(every_path):
    (t,) = every_path["sets"]["tiny_pot_set"]["per_problem"]
    assert t["answers"] == list(PROGRAMS.values()) + [None] * len(NOT_FOLDED)


def test_checkpoints_and_waves(every_path, waves_runs):
    assert every_path["sets"]["votes"]["looks"] == {"4": [1, 2, 3]}  # every path
    assert every_path["sets"]["tiny"]["looks"] == {"8": list(range(1, 8))}
    assert waves_runs["1 2 4 rest"]["args"]["waves"] == [1, 2, 4, None]
    looks = waves_runs["1 2 4 rest"]["sets"]["sizes"]["looks"]
    assert looks["40"] == [1, 3, 7] and looks["5"] == [1, 3]  # the 4-wave is cut to what is left
    assert waves_runs["3"]["args"]["waves"] == [3]
    assert waves_runs["3"]["sets"]["sizes"]["looks"]["10"] == [3, 6, 9]  # last size repeats
    for bad in (["rest", "2"], ["0"], ["x"]):
        out = run_evals("stop-rules", "--waves", *bad, "--out", "")
        assert out.returncode == 2 and "--waves takes sizes" in out.stderr and "Traceback" not in out.stderr


@pytest.fixture(scope="module")
def waves_runs(tmp_path_factory):
    """{--waves: JSON} of runs over the window set, or sets of problems of 5, 40 and 10 paths."""
    tmp = tmp_path_factory.mktemp("waves")
    window = write_votes(tmp / "window.jsonl", WINDOW)
    sizes = write_votes(tmp / "sizes.jsonl", [(f"n{n}", [0] * n, [2] * n, None) for n in (5, 40, 10)])
    return {spec: stop_rules(tmp, spec.replace(" ", "_"), traces, "--waves", *spec.split(), "--perms", "1")
            for spec, traces in (("2 rest", [window]), ("4 rest", [window]),
                                 ("1 2 4 rest", [sizes]), ("3", [sizes]))}


def test_replay_counts_samples_and_tokens(every_path, waves_runs):
    # ids 0 0 0 1 0 0, tokens 10..60, window(3): after every path it stops at 3 paths, 60 tokens, on 0
    w = every_path["sets"]["window"]
    assert w["full_tokens"] == 210
    r = w["rules"]["window(3)"]
    assert r["samples_per_problem"] == 3 and r["tokens_frac"] == pytest.approx(60 / 210)
    assert r["agreement"] == 1.0 and r["gold_acc"] == r["gold_acc_full"] == 1.0  # stopped on 0, as full-N
    # waves 2, then the rest: the rule only looks after whole waves
    # after 4 the last three are 0, 0, 1: no run, so the second wave runs to the end
    for spec, looks in (("2 rest", [2]), ("4 rest", [4])):
        w = waves_runs[spec]["sets"]["window"]
        assert w["looks"] == {"6": looks}
        r = w["rules"]["window(3)"]
        assert r["samples_per_problem"] == 6 and r["tokens_frac"] == 1.0, spec
        assert r["agreement"] == 1.0 and r["gold_acc"] == r["gold_acc_full"] == 1.0


def test_recorded_traces_end_to_end(tmp_path):
    """Three sets cut from the project's own recorded fixture (no ../shared):
    the command replays every rule, cross-validates and picks a default."""
    with open(TRACES, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    paths = []
    for i, name in enumerate(("set_a", "set_b", "set_c")):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(lines[i::3]))
        paths.append(str(path))
    data = stop_rules(tmp_path, "stopping", paths, "--perms", "2")
    assert set(data["sets"]) == {"set_a", "set_b", "set_c"} and not data["skipped"]
    for s in data["sets"].values():
        assert s["rules"]["decided"]["agreement"] == 1.0
        assert s["rules"]["decided"]["agreement_perm_worst"] == 1.0
    assert data["default"] in data["selection"]
    assert [f["held_out"] for f in data["loso"]] == list(data["sets"])
    assert os.path.exists(tmp_path / "stopping.md")


# --- the sequential rule: a guarantee over all looks ------------------------

from consensus_spec.sampling.stopping import sequential_boundary  # noqa: E402


def partitions(n, largest=None):
    """Class sizes of a multiset of n answers, largest first."""
    largest = n if largest is None else largest
    if n == 0:
        yield ()
        return
    for p in range(min(n, largest), 0, -1):
        for rest in partitions(n - p, p):
            yield (p,) + rest


def wrong_stop_probability(counts, nones, rule, looks):
    """Exact P(stopping early on an answer other than the strict full-N winner)
    over uniformly random orders of the multiset (classes with ``counts``, plus
    ``nones`` unanswerable paths); a full-N tie counts as wrong for any stop."""
    n = sum(counts) + nones
    top = [j for j, c in enumerate(counts) if c == max(counts)]
    winner = top[0] if len(top) == 1 else None
    wrong = 0.0
    states = {((0,) * len(counts), 0, ()): 1.0}  # (seen per class, Nones seen, first-seen order)
    for k in range(1, n):
        nxt = {}
        for (seen, none_seen, order), p in states.items():
            left = n - k + 1
            for j, c in enumerate(counts):
                if seen[j] < c:
                    key = (seen[:j] + (seen[j] + 1,) + seen[j + 1:], none_seen,
                           order if j in order else order + (j,))
                    nxt[key] = nxt.get(key, 0.0) + p * (c - seen[j]) / left
            if none_seen < nones:
                key = (seen, none_seen + 1, order)
                nxt[key] = nxt.get(key, 0.0) + p * (nones - none_seen) / left
        states = {}
        for (seen, none_seen, order), p in nxt.items():
            ranked = sorted(((j, seen[j]) for j in order), key=lambda kv: -kv[1])
            if k in looks and ranked and should_stop_ids([None] * k, n - k, rule, ranked=ranked):
                wrong += p * (ranked[0][0] != winner)
            else:
                states[(seen, none_seen, order)] = p
    return wrong


@pytest.mark.parametrize("error", [0.05, 0.2])
def test_sequential_error_holds_for_every_multiset_and_look_schedule(error):
    # the guarantee, checked exactly: every multiset of n <= 9 answers (up to 4
    # classes, any number of Nones), looks after every path and after waves of 2
    rule = StopRule(kind="sequential", error=error, min_samples=1)
    worst = 0.0
    for n in range(2, 10):
        assert sequential_boundary(n, error)[1] <= error
        for nones in range(n):
            for counts in partitions(n - nones):
                if len(counts) > 4:
                    continue
                for looks in (set(range(1, n)), set(range(2, n, 2))):
                    p = wrong_stop_probability(counts, nones, rule, looks)
                    assert p <= error + 1e-12, (counts, nones, sorted(looks), p)
                    worst = max(worst, p)
    assert worst > 0.5 * error  # and the rule does use its budget (not just "decided")


def test_sequential_boundary_shape():
    for n in (2, 8, 16, 40):
        for error in (0.01, 0.05, 0.2):
            h, bound = sequential_boundary(n, error)
            assert len(h) == n + 1 and h[0] is None and h[n] is None
            assert 0.0 <= bound <= error
            for k, need in enumerate(h):
                assert need is None or k / 2 < need <= k  # a majority of the paths seen
    # the worst case is a 50/50 split: at n=8, 4 of 4 stops with error 0.05 (2 * 1/70 risk)
    assert sequential_boundary(8, 0.05)[0][3:5] == (None, 4)
    assert sequential_boundary(8, 0.05)[1] == pytest.approx(2 / 70)
    assert sequential_boundary(8, 0.2)[0][3] == 3
    assert sequential_boundary(8, 0.01)[0][4] is None  # 2/70 > 0.01: only "decided" stops
    with pytest.raises(ValueError):
        sequential_boundary(0, 0.05)
    with pytest.raises(ValueError):
        sequential_boundary(8, 1.0)


def test_sequential_on_answers():
    assert first_stop(["42"] * 8, 8, kind="sequential", error=0.05) == 4
    assert first_stop(["42"] * 8, 8, kind="sequential", error=0.2) == 3
    assert first_stop(["42"] * 8, 8, kind="sequential", error=0.01) == 5  # decided
    assert first_stop(["7"] * 40, 40, kind="sequential", error=0.05) == 6
    # a stray answer costs more paths; a split never stops before it is decided
    assert first_stop(["7"] * 3 + ["8"] + ["7"] * 36, 40, kind="sequential", error=0.05) > 6
    split = ["1", "2"] * 20
    assert first_stop(split, 40, kind="sequential", error=0.2) == 40
    # Nones are paths that vote for nothing: 3 votes of 4 paths is not 4 of 4
    rule = StopRule(kind="sequential", error=0.05)
    assert should_stop_ids([0, 0, 0, 0], 4, rule)
    assert not should_stop_ids([0, 0, None, 0], 4, rule)
    assert should_stop(["5", None, "5", "5", "5", "5"], 2, rule)  # 5 of 6 at n=8
    assert not should_stop([None] * 6, 2, rule)


def test_should_stop_input_errors_and_purity():
    answers = ["1", "1", "1", "1"]
    for bad in (-1, 1.5, 2.0, True, "3", None):
        with pytest.raises(ValueError, match="remaining"):
            should_stop(answers, bad)
    import numpy as np
    assert should_stop(answers, np.int64(4), kind="sequential", error=0.05)
    for bad in ("1111", 42, [1, 2], ["1", 2.0]):
        with pytest.raises(TypeError, match="answers"):
            should_stop(bad, 3)
    with pytest.raises(TypeError, match="StopRule"):
        should_stop(answers, 3, "sequential")
    before = list(answers)
    results = {should_stop(answers, 4, StopRule(kind="sequential", error=0.05)) for _ in range(3)}
    assert results == {True} and answers == before
    assert should_stop(("1", "1", "1", "1"), 4, kind="sequential", error=0.05)  # any sequence


# --- leave-one-set-out -------------------------------------------------------

def fake_rule(kind, error, tokens, agree, worst, gold=None):
    return {"rule": {"kind": kind, "error": error, "min_samples": 3},
            "tokens_frac_perm_mean": tokens, "tokens_frac_perm_worst": tokens,
            "agreement_perm_mean": agree, "agreement_perm_worst": worst, "agreement": agree,
            "gold_acc_perm_mean": gold, "gold_acc_full": gold}


def fake_sets():
    def rules(seq_agree, pred_agree):
        return {"decided": fake_rule("decided", 0.2, 0.7, 1.0, 1.0),
                "seq_lo": fake_rule("sequential", 0.05, 0.45, 1.0, 1.0),
                "seq_hi": fake_rule("sequential", 0.2, 0.35, seq_agree, 0.99),
                "pred": fake_rule("predictive", 0.05, 0.3, pred_agree, 0.99)}
    return {"a": {"rules": rules(0.999, 0.999), "hard_problems": 0},
            "b": {"rules": rules(0.998, 0.97), "hard_problems": 0},
            "c": {"rules": rules(0.99, 0.999), "hard_problems": 0}}


def selection(tmp, name, sets, *extra):
    """``python -m evals stop-rules --from-json`` on a saved result holding ``sets``: (JSON, stdout)."""
    saved, out = tmp / f"{name}_saved.json", tmp / f"{name}.json"
    saved.write_text(json.dumps({"args": {"waves": [2]}, "skipped": {}, "sets": sets}))
    stdout = ok(run_evals("stop-rules", "--from-json", saved, "--out", out, *extra))
    return read_json(out), stdout


@pytest.fixture(scope="module")
def picked(tmp_path_factory):
    """The selection redone on the fake sets a, b, c, with the trade-off plot."""
    tmp = tmp_path_factory.mktemp("picked")
    data, stdout = selection(tmp, "abc", fake_sets(), "--plot", tmp / "tradeoff.png")
    return data, stdout, tmp / "tradeoff.png"


@pytest.fixture(scope="module")
def nothing_passes(tmp_path_factory):
    """One set where no rule with a guarantee meets the targets."""
    low_gold = dict(fake_rule("sequential", 0.2, 0.3, 1.0, 1.0), gold_acc_perm_mean=0.80, gold_acc_full=0.81)
    rules = {"decided": fake_rule("decided", 0.2, 0.7, 1.0, 0.98),
             "seq_tight": fake_rule("sequential", 0.001, 0.3, 0.998, 0.99),
             "low_gold": low_gold,
             "pred_ok": fake_rule("predictive", 0.005, 0.3, 0.998, 0.99)}
    return selection(tmp_path_factory.mktemp("nothing"), "only", {"only": {"rules": rules, "hard_problems": 0}})[0]


def test_targets_and_picks(picked, nothing_passes):
    data = picked[0]
    assert data["meets"]["a"]["seq_hi"] and not data["meets"]["c"]["seq_hi"]
    # realized disagreement above the nominal error fails, whatever the agreement
    assert not nothing_passes["meets"]["only"]["seq_tight"]
    # gold accuracy more than 0.5 points below full-N fails
    assert not nothing_passes["meets"]["only"]["low_gold"]
    assert nothing_passes["meets"]["only"]["pred_ok"]  # the same figures with a looser nominal error pass
    by_held = {f["held_out"]: f for f in data["loso"]}
    by_held_any = {f["held_out"]: f for f in data["loso_any_rule"]}
    assert by_held["c"]["tuned_on"] == ["a", "b"] and by_held["c"]["rule"] == "seq_hi"  # guaranteed kinds
    assert by_held_any["b"]["tuned_on"] == ["a", "c"] and by_held_any["b"]["rule"] == "pred"  # any rule
    # nothing with a guarantee passes: decided
    assert nothing_passes["default"] == "decided"


def test_loso_tunes_on_the_other_sets_and_reports_held_out(picked, nothing_passes):
    data = picked[0]
    folds = data["loso"]
    assert [f["held_out"] for f in folds] == ["a", "b", "c"]
    assert [f["tuned_on"] for f in folds] == [["b", "c"], ["a", "c"], ["a", "b"]]
    # held out a or b, c is a tuning set and rules seq_hi out; held out c, seq_hi is picked
    assert [f["rule"] for f in folds] == ["seq_lo", "seq_lo", "seq_hi"]
    assert [f["meets"] for f in folds] == [True, True, False]  # ... and misses on c
    assert data["default"] == "seq_lo"  # folds disagree: the most cautious pick
    assert data["sets"] == fake_sets()  # the saved figures, not replayed
    assert nothing_passes["loso"] == [] and nothing_passes["loso_any_rule"] == []  # one set: no folds


def test_tradeoff_plot(picked):
    _, stdout, path = picked
    made = f"wrote {path}" in stdout  # no plot (a note on stderr) without matplotlib
    assert made is (path.exists() and path.stat().st_size > 1000)


def test_from_json_errors(tmp_path):
    out = run_evals("stop-rules", "--from-json", tmp_path / "missing.json", "--out", tmp_path / "x.json")
    assert out.returncode == 2 and "not a saved stop-rules result" in out.stderr and "Traceback" not in out.stderr
