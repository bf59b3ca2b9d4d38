"""The device-route replay (evals/replay/device_route.py): sibling tokens reach the
tries exactly ``lag`` calls late, the row's own context is current, and every
draft is exactly K tokens (or none at K = 0)."""

import numpy as np
import pytest

from consensus_spec.drafting.drafter import DrafterOptions
from evals.replay.device_route import DeviceRouteDrafter
from evals.replay.drafters import make_drafter
from evals.replay.engine import ReplayBatch, replay
from evals.traces import Problem

PROMPT = [900, 901, 902, 903]
SIB = [10, 11, 12, 13, 14, 15, 16, 17]  # what the sibling writes, one token per call


class Rows:
    """Two rows of one prompt driven by hand, one call per step: row 0 (the
    sibling) writes SIB one token per call; row 1 (the follower) starts with
    SIB[0] and writes only what a call gives it (real rows write at least a
    token each step; the drafter does not depend on it)."""

    def __init__(self, lag, k=2):
        self.batch = ReplayBatch(2, 64)
        self.drafter = DeviceRouteDrafter(lag, lambda rows: k, DrafterOptions(min_match=1))
        self.n = [len(PROMPT) + 1, len(PROMPT) + 1]
        for i in range(2):
            self.batch.req_ids.append(f"0-{i}")
            self.batch.num_prompt_tokens[i] = len(PROMPT)
            self.batch.token_ids_cpu[i, :self.n[i]] = PROMPT + [SIB[0]]
            self.batch.num_tokens_no_spec[i] = self.n[i]
        self.sampled = [[SIB[0]], [SIB[0]]]  # call 1: both rows' first token

    def write(self, row, token):
        self.batch.token_ids_cpu[row, self.n[row]] = token
        self.n[row] += 1
        self.batch.num_tokens_no_spec[row] = self.n[row]
        self.sampled[row].append(token)

    def call(self, follower=None):
        """The next call: the follower's new token (if any) and the drafts."""
        if follower is not None:
            self.write(1, follower)
        drafts = self.drafter(self.sampled, self.batch)
        written = self.n[0] - len(PROMPT)  # the sibling writes its next token for the next call
        self.sampled = [[], []]
        if written < len(SIB):
            self.write(0, SIB[written])
        return drafts


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_a_siblings_token_written_at_call_t_is_draftable_from_call_t_plus_lag(lag):
    rows = Rows(lag)
    # The follower's context ends in SIB[0]; what follows it, SIB[1], exists only
    # in the sibling's tokens, written at call 2: drafted from call 2 + lag on.
    for call in range(1, 7):
        draft = rows.call()[1]
        assert len(draft) == 2
        assert (draft[0] == SIB[1]) == (call >= 2 + lag), (call, draft)
        if call < 2 + lag:
            assert draft == [SIB[0]] * 2  # a miss: K fill tokens, the row's last token


def test_the_rows_own_tokens_are_current_in_its_lookup_while_the_tries_lag():
    rows = Rows(lag=2)
    for _ in range(6):   # the sibling writes SIB[0..5]; the tries hold SIB[0..3] at call 6
        rows.call()
    # the follower writes SIB[1] and SIB[2] at call 7: the tries have not seen them
    # (its own tokens lag too), but its lookup context does: it drafts SIB[3], SIB[4]
    # from the sibling's (lagged) tokens at once
    rows.write(1, SIB[1])
    assert rows.call(follower=SIB[2])[1] == [SIB[3], SIB[4]]


def problems(n_problems=3, n_samples=5):
    out = []
    for p in range(n_problems):
        base = [30 + p, 31, 32, 33, 34, 35, 36, 37]
        comps = [base + ([40, 41] if s % 2 else [50, 51, 52]) + base[:4] + [2] for s in range(n_samples)]
        out.append(Problem(f"p{p}", [1000 + p] + list(range(10, 20)), comps))
    return out


@pytest.mark.parametrize("method", ["device-lag1", "device-lag2"])
def test_drafts_are_exactly_k_or_zero_and_follow_the_schedule(method):
    probs = problems()
    rows, k = 6, 4
    max_len = max(len(p.prompt) + max(map(len, p.completions)) for p in probs) + k + 2
    schedule = [(1, 3, 3), (4, 6, 0)]   # full batches: off; the tail (<= 3 rows): K = 3
    drafter = make_drafter(method, k, max_len, rows, schedule=schedule)
    lengths = []

    def spy(sampled, batch):
        drafts = drafter(sampled, batch)
        want = 3 if len(sampled) <= 3 else 0
        lengths.append({len(d) for d in drafts})
        assert all(len(d) == want for d in drafts), (len(sampled), drafts)
        return drafts

    stats = replay(probs, spy, method, k, rows)
    assert {0} in lengths and {3} in lengths
    assert stats.tokens == sum(len(c) for p in probs for c in p.completions) - sum(
        len(p.completions) for p in probs)  # every recorded token, first ones aside
    assert stats.drafted == 3 * sum(n for n, d in zip(stats.step_rows, stats.step_drafted) if d)


def test_every_lag_drafts_and_route_stats_count_the_table():
    probs = problems(n_problems=4, n_samples=8)
    k, rows = 3, 8
    max_len = max(len(p.prompt) + max(map(len, p.completions)) for p in probs) + k + 2
    for lag in (0, 1, 2):
        d = make_drafter(f"device-lag{lag}", k, max_len, rows)
        stats = replay(probs, d, "device", k, rows)
        s = d.route_stats()
        assert stats.tau > 1.0 and stats.drafted == k * stats.row_steps
        assert s["lag"] == lag and 0.0 < s["hit_rate"] <= 1.0
        assert s["table_entries"] > 0 and s["refresh_full_bytes"] == pytest.approx(
            s["table_entries"] * (8 + 4 * k))
        assert 0 < s["refresh_delta_bytes"] <= s["refresh_full_bytes"]


def test_table_bolds_the_view_each_route_runs_under():
    from evals.replay.device_route import table

    base = {"traces": "addsub_x", "batch": 128, "tau": 2.0, "drafts_per_step": 2.0}
    results = [{**base, "method": "consensus", "speedup": 1.2, "speedup_async": 0.9},
               {**base, "method": "device-lag1", "k_at_batch": 2, "speedup": 1.1, "speedup_async": 1.0}]
    lines = table(results).splitlines()
    assert "| 1.20 | **0.90** |" in lines[2] and "per row" in lines[2]
    assert "| **1.10** | 1.00 |" in lines[3] and "| 2 |" in lines[3]
