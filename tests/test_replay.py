import json
import os

import pytest

from evals.drafters import make_drafter
from evals.projection import StepCosts
from evals.replay import replay
from evals.replay_bench import main as replay_main
from evals.traces import Problem, TraceError, load_problems, shared_path


class CharTokenizer:
    """Stands in for a `tokenizers.Tokenizer`: one token per character."""

    class _Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode_batch(self, texts):
        return [self._Enc([ord(c) for c in t]) for t in texts]


def synthetic_problems(n_problems=4, n_samples=6):
    problems = []
    for p in range(n_problems):
        prompt = [1000 + p] + list(range(10, 20))
        base = [30 + p, 31, 32, 33, 34, 35, 36, 37]
        comps = []
        for s in range(n_samples):
            tail = [40 + (s % 2), 42, 43, 44] if s % 3 else [50, 51]
            comps.append(base + tail + [2])
        problems.append(Problem(f"p{p}", prompt, comps))
    return problems


def run(method, problems, scouts=0, k=4, rows=8):
    max_len = max(len(p.prompt) + max(map(len, p.completions)) for p in problems) + k + 2
    return replay(problems, make_drafter(method, k, max_len, rows), method, k, rows, scouts)


def test_no_drafting_takes_one_token_per_step():
    problems = synthetic_problems()
    s = run("none", problems)
    total = sum(len(c) - 1 for p in problems for c in p.completions)  # first token comes from prefill
    assert s.tokens == total and s.row_steps == total
    assert s.tau == 1.0 and s.drafted == 0


def test_consensus_reproduces_the_trace_and_accepts_sibling_text():
    problems = synthetic_problems()
    s = run("consensus", problems)
    total = sum(len(c) - 1 for p in problems for c in p.completions)
    assert s.tokens == total  # every recorded token is produced exactly once
    assert s.tau > 1.5 and 0 < s.acceptance <= 1
    # each step yields accepted + 1 tokens, except a final step whose draft ran to EOS
    assert s.tokens - s.row_steps <= s.accepted <= s.tokens


def test_scouts_let_followers_draft_from_finished_siblings():
    problems = synthetic_problems(n_problems=6, n_samples=6)
    s0, s1 = run("consensus", problems, 0), run("consensus", problems, 1)
    assert s1.tokens == s0.tokens
    assert s1.tau > s0.tau


def test_condense_keeps_rows_consistent_with_small_batches():
    problems = synthetic_problems(n_problems=5, n_samples=7)
    s = run("consensus", problems, rows=3)
    assert s.tokens == sum(len(c) - 1 for p in problems for c in p.completions)


def test_bad_trace_files_give_clear_errors_or_skips(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(TraceError, match="no replayable problems"):
        load_problems(str(empty), CharTokenizer())
    with pytest.raises(TraceError, match="not found"):
        load_problems(str(tmp_path / "missing.jsonl"), CharTokenizer())
    mixed = tmp_path / "mixed.jsonl"
    rows = [
        {"prompt": "q1", "completions": ["only one"]},
        {"prompt": "q2", "completions": ["", "a", "b"]},
        {"prompt": "", "completions": ["a", "b"]},
        "not json",
    ]
    mixed.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows))
    messages = []
    problems = load_problems(str(mixed), CharTokenizer(), log=messages.append)
    assert [p.id for p in problems] == ["line2"]
    assert len(problems[0].completions) == 2  # the empty completion is dropped
    assert any("fewer than 2" in m for m in messages) and any("invalid JSON" in m for m in messages)


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    tok = shared_path("tokenizers", "gpt2", "tokenizer.json")
    if not os.path.exists(tok):
        pytest.skip(f"shared data not found at {tok}")
    code = replay_main(["--traces", str(empty), "--methods", "consensus", "--out", str(tmp_path / "r")])
    assert code == 2
    assert "no replayable problems" in capsys.readouterr().err


def test_projection_matches_the_formula():
    rows = [{"B": 16, "q": q, "ms": ms} for q, ms in ((1, 10.0), (2, 11.0), (3, 13.0))]
    costs = StepCosts(rows)
    assert costs.step_ms(16, 2.5) == pytest.approx(12.0)
    # tau 2, 1.5 drafts per step, 100 µs per row over 16 rows = 1.6 ms
    assert costs.speedup(16, 2.0, 1.5, 100.0) == pytest.approx(2.0 * 10.0 / (12.0 + 1.6))
    with pytest.raises(ValueError):
        costs.step_ms(64, 1.0)


SHARED_TRACES = shared_path("traces", "gsm8k_qwen3_4b_n8.jsonl")


@pytest.mark.skipif(not os.path.exists(SHARED_TRACES), reason=f"shared traces not found at {SHARED_TRACES}")
def test_real_traces_consensus_beats_no_drafting(tmp_path):
    code = replay_main(["--traces", SHARED_TRACES, "--limit", "3", "--methods", "none", "consensus",
                        "--scouts", "0", "--out", str(tmp_path / "r")])
    assert code == 0
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    tau = {r["method"]: r["tau"] for r in results}
    assert tau["none"] == 1.0 and tau["consensus"] > 1.3


@pytest.mark.skipif(not os.path.exists(SHARED_TRACES), reason=f"shared traces not found at {SHARED_TRACES}")
def test_budget_floor_only_skips_drafting_that_could_not_pay(monkeypatch):
    """The drafter stops walking below the budget's floor; what it sends must
    be exactly what the budget would have kept from full-length drafts."""
    from consensus_spec.budget import DraftBudget
    from evals.traces import load_tokenizer

    problems = load_problems(SHARED_TRACES, load_tokenizer(None), limit=30)
    pruned = run("consensus", problems, k=8, rows=128)
    floors = []
    real_floor = DraftBudget.floor
    monkeypatch.setattr(DraftBudget, "floor", lambda self, b: floors.append(real_floor(self, b)) or 0.0)
    full = run("consensus", problems, k=8, rows=128)
    assert max(floors) > 0.1  # the floor did prune at this batch size
    assert (pruned.tokens, pruned.row_steps, pruned.drafted, pruned.accepted) == \
        (full.tokens, full.row_steps, full.drafted, full.accepted)
