import json
import os

import numpy as np
import pytest

from consensus_spec.budget import COST_MODELS, choose_lengths, cost_model

H200 = COST_MODELS["h200_7b"]


def choose(rows, batch):
    """choose_lengths on ragged rows of estimates."""
    k = max([len(r) for r in rows] + [1])
    probs = np.zeros((len(rows), k))
    for i, r in enumerate(rows):
        probs[i, :len(r)] = r
    return list(choose_lengths(probs, np.array([len(r) for r in rows]), batch, H200))


def test_small_batches_draft_long_large_batches_only_what_pays():
    confident = [1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65]
    doubtful = [0.3, 0.1, 0.05]
    small = choose([confident, doubtful] * 8, 16)
    large = choose([confident, doubtful] * 64, 128)
    assert small[0] == 8 and small[1] >= 1
    assert large[0] < 8 and large[1] == 0
    assert sum(large) / 128 < sum(small) / 16


def test_lengths_are_prefixes_of_the_drafts_and_rows_without_drafts_count():
    probs = [[0.9, 0.5], [], [0.99]]
    lengths = choose(probs, 3)
    assert all(0 <= n <= len(p) for n, p in zip(lengths, probs))
    assert choose([[], []], 2) == [0, 0]


def test_choice_maximises_expected_tokens_per_step_time():
    rng = np.random.default_rng(0)
    probs = [sorted(rng.uniform(0, 1, 8), reverse=True) for _ in range(64)]
    probs = [list(np.cumprod(p)) for p in probs]
    lengths = choose(probs, 64)

    def rate(ls):
        gain = 64 + sum(sum(p[:n]) for p, n in zip(probs, ls))
        return gain / H200.step_ms(64, 1 + sum(ls) / 64)

    best = rate(lengths)
    for delta in (-1, 1):  # no uniform nudge of the threshold does better
        assert rate([max(0, min(len(p), n + delta)) for p, n in zip(probs, lengths)]) <= best + 1e-9


def test_unknown_cost_model_is_a_clear_error():
    assert cost_model("off") is None
    with pytest.raises(ValueError, match="unknown cost model"):
        cost_model("h100_70b")


# tests/fixtures/step_costs.jsonl, made by this project: COST_MODELS["h200_7b"].step_ms on the grid
# of the measured table that model was fitted to (../shared/data/costs/h200_qwen2.5-7b_step_ms.jsonl,
# mean error 3%), B in (1, 8, 16, 32, 64, 128) x q in (1, 2, 3, 5, 9, 17), rounded to 4 decimals:
#   {"B": b, "q": q, "ms": round(float(COST_MODELS["h200_7b"].step_ms(b, q)), 4)}
TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "step_costs.jsonl")


def test_h200_model_keeps_its_fitted_values_and_a_table_of_them_fits_back():
    """The H200 model still gives the step costs it was fitted to give (changing
    its constants is a refit, done on purpose, with this table remade), and a
    table of that shape (a bent roofline, sharpness > 1) fits back to it."""
    rows = [json.loads(line) for line in open(TABLE)]
    assert len(rows) == 36
    err = [abs(H200.step_ms(r["B"], r["q"]) - r["ms"]) / r["ms"] for r in rows]
    assert max(err) < 1e-4
    fitted = cost_model(TABLE)
    err = [abs(fitted.step_ms(r["B"], r["q"]) - r["ms"]) / r["ms"] for r in rows]
    assert np.mean(err) < 0.01 and max(err) < 0.03
    assert fitted.sharpness > 1.5


def test_calibrator_learns_that_estimates_run_high():
    from consensus_spec.budget import AcceptanceCalibrator

    cal = AcceptanceCalibrator(bins=10, prior=5.0, decay=1.0)
    assert cal([[0.95]])[0, 0] == pytest.approx(0.95)  # unseen: trusts the estimate
    rng = np.random.default_rng(0)
    for _ in range(200):  # the drafter says 0.95, the verifier accepts 30%
        cal.observe([[0.95, 0.0]], [1], [int(rng.uniform() < 0.3)])
    assert cal([[0.95]])[0, 0] == pytest.approx(0.3, abs=0.08)
    assert cal([[0.05]])[0, 0] == pytest.approx(0.05)  # only sent entries were observed
    # along a draft the calibrated chance never rises
    out = cal([[0.95, 0.55]])[0]
    assert out[1] <= out[0]


def test_a_bin_nothing_lands_in_keeps_its_rate_for_good():
    """Decay makes the map follow the workload; a bin no sent draft lands
    in (estimates below every floor) must not decay into the denormals,
    where its hits and trials round alike and it read as certain (1.0)
    after about 150,000 sending steps."""
    from consensus_spec.budget import AcceptanceCalibrator

    cal = AcceptanceCalibrator(bins=20, prior=20.0, decay=0.995)
    for _ in range(200_000):  # every step sends one sure token: only the top bin sees anything
        cal.observe(np.array([[0.99]]), np.array([1]), np.array([1]))
    hits, trials = cal.counts()
    assert cal.rate()[0] == pytest.approx(0.025) and trials[0] > 0
    assert np.isfinite(cal.rate()).all() and (trials >= 1e-10).all()
    assert cal.rate()[-1] == pytest.approx(1.0)


def test_greedy_choice_equals_exhaustive_search_over_thresholds():
    rng = np.random.default_rng(1)
    for batch in (4, 16, 128):
        probs = np.cumprod(rng.uniform(0.3, 1.0, (batch, 8)), axis=1)
        lengths = rng.integers(0, 9, batch)
        got = choose_lengths(probs, lengths, batch, H200)
        # exhaustive: every count of the most likely entries, kept as prefixes
        flat = np.sort(np.concatenate([p[:n] for p, n in zip(probs, lengths)]))[::-1]
        gains = batch + np.concatenate(([0.0], np.cumsum(flat)))
        rates = gains / H200.step_ms(batch, 1.0 + np.arange(len(gains)) / batch)
        best = int(np.argmax(rates))
        assert got.sum() == best
        assert (got <= lengths).all()
        if best:
            assert min(p[n - 1] for p, n in zip(probs, got) if n) >= flat[best - 1]


def reference_choice(probs, lengths, batch, step_ms, rate):
    """The greedy of ``_choose`` spelt out: every draft token with its
    calibrated chance (capped at 1, never rising along a draft), sorted
    likeliest first, then by row, then by position; kept while the rate
    rises. Returns (lengths, slack)."""
    k = probs.shape[1]
    cal = (lambda p: p) if not len(rate) else (lambda p: rate[min(max(int(p * len(rate)), 0),
                                                                   len(rate) - 1)])
    tokens = []
    for i in range(len(probs)):
        low = 1.0
        for j in range(min(lengths[i], k)):
            low = min(low, cal(probs[i, j]))
            tokens.append((-low, i, j))
    out = np.zeros(len(probs), np.int64)
    gain, kept, last = float(batch), 0, np.inf
    best = gain / step_ms[0]
    for neg, i, _ in sorted(tokens):
        if kept + 1 >= len(step_ms) or (gain - neg) / step_ms[kept + 1] <= best:
            break
        kept += 1
        best, gain, last = (gain - neg) / step_ms[kept], gain - neg, -neg
        out[i] += 1
    slack = -np.inf if kept + 1 >= len(step_ms) else min(last, best * step_ms[kept + 1] - gain)
    return out, slack


def test_the_choice_takes_tokens_likeliest_first_ties_to_the_lower_row():
    """``_choose`` (a counting sort by calibrated chance, or a stable sort
    uncalibrated) keeps what the plain greedy keeps, with the same slack:
    calibrated rates with ties between bins and above 1, uncalibrated
    chances with ties, tables cut short, rows with no draft."""
    from consensus_spec.budget.policy import _choose

    rng = np.random.default_rng(7)
    checked = 0
    for trial in range(300):
        rows, k = int(rng.integers(1, 40)), int(rng.integers(1, 9))
        batch = rows + int(rng.integers(0, 8))
        probs = np.round(np.sort(rng.random((rows, k)), axis=1)[:, ::-1], 1)  # ties
        lengths = rng.integers(-1, k + 2, rows)
        bins = int(rng.integers(1, 21)) if trial % 3 else 0
        rate = np.round(rng.uniform(0.0, 1.1, bins), 1)  # ties between bins, some above 1
        step_ms = H200.step_ms(batch, 1.0 + np.arange(rows * k + 1) / batch)
        if trial % 5 == 0:
            step_ms = step_ms[:int(rng.integers(1, len(step_ms) + 1))]  # cut short
        expected, slack = reference_choice(probs, lengths, batch, step_ms, rate)
        out = np.empty(rows, np.int64)
        got = _choose(probs, lengths, batch, step_ms, rate, out)
        assert np.array_equal(out, expected) and got == slack
        checked += expected.sum() > 0
    assert checked > 100


def test_a_measured_table_replaces_the_model(tmp_path):
    truth = COST_MODELS["cpu_embedded"]
    table = tmp_path / "costs.jsonl"
    table.write_text("".join(json.dumps({"B": b, "q": q, "ms": float(truth.step_ms(b, q))}) + "\n"
                             for b in (16, 64, 256) for q in (1, 2, 5, 9)))
    fitted = cost_model(str(table))
    for b, q in ((32, 3), (128, 7)):
        assert fitted.step_ms(b, q) == pytest.approx(truth.step_ms(b, q), rel=0.02)
    with pytest.raises(ValueError, match="unknown cost model"):
        cost_model("table")
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="cannot read"):
        cost_model(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="cannot read"):
        cost_model(str(tmp_path / "missing.jsonl"))


def test_auto_cost_model_follows_the_device():
    from types import SimpleNamespace

    from consensus_spec import ConsensusProposer
    from tests.stand_in import stand_in_config

    cfg = stand_in_config(k=4, max_model_len=100, max_num_seqs=8)
    assert ConsensusProposer(cfg).budget.model == COST_MODELS["h200_7b"]
    cfg.device_config = SimpleNamespace(device_type="cpu")
    assert ConsensusProposer(cfg).budget.model == COST_MODELS["cpu_embedded"]
    assert ConsensusProposer(cfg, cost_model="off").budget is None


def test_an_ordinary_step_in_one_call_equals_its_parts():
    """With learned costs, an ordinary step's floor and kept lengths come
    from one compiled call each: the same as the first token's cost, the
    budget's step-time table, calibrated rates and greedy choice, taken
    one by one."""
    from consensus_spec.budget import DraftBudget
    from consensus_spec.budget.online import DRAFTER, THETA
    from consensus_spec.budget.policy import _choose

    rng = np.random.default_rng(3)
    b = DraftBudget(cost_model("h200_7b"), online=True)
    for step in range(200):  # a fit and a calibration away from their priors
        b.observe_step(32, step % 40, 6.0 + 0.03 * (step % 40) + rng.normal(0, 0.05), 0.05)
        probs = np.sort(rng.random((32, 6)), axis=1)[:, ::-1].copy()
        sent = rng.integers(0, 4, 32)
        b.observe(probs, sent, np.minimum(sent, rng.integers(0, 3, 32)))
    checked = 0
    for batch in (1, 16, 32, 100):
        for _ in range(30):
            floor = b.floor(batch)
            costs, cal = b.costs, b.calibrator
            if b._draft:
                s = costs._state[costs._bucket(batch)]
                a, c1, c2, drafter = s[THETA], s[THETA + 1], s[THETA + 2], s[DRAFTER]
                inc1 = costs._prior_at(batch, 1)[1][1]
                extra = max(1.0 - b._shade, 0.0) * max(c1 / batch + c2 * inc1, 0.0)
                safe = b.safe_floor if b._raised else floor  # a raised floor keeps the safe one
                assert floor >= safe
                assert safe == cal.lowest_estimate_above(batch * extra / (max(a, 1e-3) + drafter))
            rows = int(rng.integers(1, batch + 1))
            probs = np.sort(rng.random((rows, 6)), axis=1)[:, ::-1].copy()
            lengths = rng.integers(0, 7, rows).astype(np.int32)
            if b._explore or not b._draft:
                b(probs, lengths, batch)  # the step is spent
                continue
            expected = np.empty(rows, np.int64)
            tokens = int(np.minimum(lengths, 6).sum())
            _choose(probs, lengths, batch, b.step_ms(batch, tokens), cal.rate(), expected)
            assert np.array_equal(b(probs, lengths, batch), expected)
            checked += 1
    assert checked > 60 and len(b._table) > 0  # the one-call path ran (its scratch grew)


@pytest.mark.parametrize("online", [True, False])
def test_a_raised_floor_cuts_only_walks_the_choice_would_not_keep(online):
    """An ordinary step's floor rises to what the last choice at its batch
    size left unkept; the tokens that floor cuts from the walks change
    nothing, or the call says to walk again (redraft): never a different
    choice. With learned step costs and with a fixed cost model."""
    from consensus_spec.budget import DraftBudget
    from consensus_spec.budget.policy import _choose

    rng = np.random.default_rng(7)
    b = DraftBudget(cost_model("h200_7b"), online=online)
    b.guard = None  # drafting stays on: the guard is not what this checks
    for step in range(300):  # learned: draft tokens cheap up to 40 a step, dear beyond
        d = step % 80
        b.observe_step(64, d, 6.0 + 0.01 * d + 0.1 * max(d - 40, 0) + rng.normal(0, 0.05), 0.05)
        probs = np.cumprod(rng.uniform(0.6, 1.0, (64, 8)) ** 2, axis=1)
        sent = rng.integers(0, 6, 64)
        ok = rng.random((64, 8)) < probs  # each prefix accepted as often as estimated
        accepted = np.argmin(np.concatenate([ok, np.zeros((64, 1), bool)], axis=1), axis=1)
        b.observe(probs, sent, np.minimum(accepted, sent))

    def walk(chances, room, floor):  # a walk stops below the floor or at its room
        lengths = np.minimum((chances >= floor).sum(axis=1), room).astype(np.int32)
        return np.where(np.arange(8) < lengths[:, None], chances, 0.0), lengths

    raised = kept_same = 0
    for step in range(300):
        floor = b.floor(64)
        chances = np.cumprod(rng.uniform(0.6, 1.0, (64, 8)) ** 2, axis=1)
        forced = step % 10 == 9
        if forced:  # a slack far above this step's: the raised floor cuts too much
            saved = b._slack[64].copy()
            b._slack[64, 0] = 1.0
            floor = b.floor(64)
        room = rng.integers(0, 9, 64)
        probs, lengths = walk(chances, room, floor)
        if b._explore or not b._draft:
            b(probs, lengths, 64)
            continue
        if b._raised == 0.0:
            b(probs, lengths, 64)
            continue
        raised += 1
        assert floor > b.safe_floor
        full, full_lengths = walk(chances, room, b.safe_floor)
        expected = np.empty(64, np.int64)
        _choose(full, full_lengths, 64, b.step_ms(64, int(full_lengths.sum())), b.calibrator.rate(),
                expected)
        out = b(probs, lengths, 64)
        if not b.redraft:
            assert np.array_equal(out, expected)
            kept_same += 1
        else:  # the proposer walks again at the safe floor and asks once more
            assert b._slack[64, 1] < saved[1] if forced else True  # it raises less next time
            assert np.array_equal(b(full, full_lengths, 64), expected) and not b.redraft
        if forced:
            b._slack[64] = saved
    assert raised > 100 and kept_same > 0.7 * raised and b.redrafts >= 20, \
        (raised, kept_same, b.redrafts)
