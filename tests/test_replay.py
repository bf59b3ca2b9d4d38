import json
import os
import subprocess
import sys

import pytest

from evals.replay.drafters import make_drafter
from evals.replay.projection import StepCosts
from evals.replay.engine import replay
from evals.traces import Problem, TraceError, TraceTokenizer, load_problems, load_tokenizer

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
# 16 synthetic problems x 8 samples of the embedded model, recorded with
#   python -m evals record --out tests/fixtures/embedded_n8.jsonl --dataset synthetic --limit 16
#       --n 8 --max-tokens 96 --temperature 0.8 --dtype float32 --max-model-len 512 --seed 0
TRACES = os.path.join(FIXTURES, "embedded_n8.jsonl")
# COST_MODELS["h200_7b"].step_ms at B 1..128, q 1..17, rounded (the budget's own H200 model,
# standing in for ../shared/data/costs; tests/test_budget.py says how it was made)
STEP_COSTS = os.path.join(FIXTURES, "step_costs.jsonl")


def run_evals(*args, timeout=300):
    """``python -m evals ARGS`` from the repository root, as a user runs it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-m", "evals", *args], cwd=root, capture_output=True,
                          text=True, timeout=timeout)


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


def test_cli_reports_errors_without_traceback(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = run_evals("replay", "--traces", str(empty), "--methods", "consensus", "--costs", STEP_COSTS,
                    "--host-time", "none", "--out", str(tmp_path / "r"))
    assert out.returncode == 2
    assert "no replayable problems" in out.stderr and "Traceback" not in out.stderr


def test_projection_matches_the_formula():
    rows = [{"B": 16, "q": q, "ms": ms} for q, ms in ((1, 10.0), (2, 11.0), (3, 13.0))]
    costs = StepCosts(rows)
    assert costs.step_ms(16, 2.5) == pytest.approx(12.0)
    # tau 2, 1.5 drafts per step, 100 µs per row over 16 rows = 1.6 ms
    assert costs.speedup(16, 2.0, 1.5, 100.0) == pytest.approx(2.0 * 10.0 / (12.0 + 1.6))
    with pytest.raises(ValueError):
        costs.step_ms(64, 1.0)


def test_recorded_traces_consensus_beats_no_drafting(tmp_path):
    out = run_evals("replay", "--traces", TRACES, "--limit", "3", "--methods", "none", "consensus",
                    "--scouts", "0", "--batches", "16", "--schedules", "fixed",
                    "--costs", STEP_COSTS, "--host-time", "none", "--out", str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    tau = {r["method"]: r["tau"] for r in results}
    speedup = {r["method"]: r["speedup"] for r in results}
    # the embedded model's siblings share most of their text: tau 2.0 on these three problems
    assert tau["none"] == 1.0 and tau["consensus"] > 1.5
    assert speedup["none"] == 1.0 and speedup["consensus"] > 1.0


def test_budget_floor_only_skips_drafting_that_could_not_pay(monkeypatch):
    """The drafter stops walking below the budget's floor; what it sends must
    be exactly what the budget would have kept from full-length drafts."""
    from consensus_spec.budget import DraftBudget

    problems = load_problems(TRACES)  # 16 x 8 paths: one batch of 128 rows
    pruned = run("consensus", problems, k=8, rows=128)
    floors = []
    real_floor = DraftBudget.floor
    monkeypatch.setattr(DraftBudget, "floor", lambda self, b: floors.append(real_floor(self, b)) or 0.0)
    full = run("consensus", problems, k=8, rows=128)
    assert max(floors) > 0.1  # the floor did prune at this batch size
    assert (pruned.tokens, pruned.row_steps, pruned.drafted, pruned.accepted) == \
        (full.tokens, full.row_steps, full.drafted, full.accepted)


# --- recorded traces (python -m evals record) --------------------------------


def test_recorded_ids_replay_without_a_tokenizer():
    rows = [json.loads(line) for line in open(TRACES)]
    problems = load_problems(TRACES)  # no tokenizer: the ids are in the file
    assert [p.id for p in problems] == [r["id"] for r in rows]
    for p, r in zip(problems, rows):
        eos = r["meta"]["eos_token_id"]
        assert p.prompt == r["prompt_ids"]
        assert len(p.completions) == len(r["completions"]) == len(r["answers"]) == 8
        for got, ids, why in zip(p.completions, r["completion_ids"], r["finish_reasons"]):
            assert got[-1] == eos  # every path ends with EOS, as in text traces
            assert got == (ids if why == "stop" else ids + [eos])
    tokenizer = load_tokenizer(None)
    load_problems(TRACES, tokenizer)
    # the recorded texts tokenize to their ids without loading a tokenizer (the stopping
    # and waves replays count tokens through encode_batch)
    first = rows[0]
    assert [e.ids for e in tokenizer.encode_batch(first["completions"])] == \
        [ids[:-1] if ids[-1] == first["meta"]["eos_token_id"] else ids for ids in first["completion_ids"]]
    assert tokenizer._tokenizer is None


def test_bad_recorded_files_name_the_line(tmp_path):
    good = json.dumps({"id": "a", "prompt": "q", "completions": ["x", "y"], "prompt_ids": [1, 5],
                       "completion_ids": [[7, 2], [8]], "meta": {"eos_token_id": 2}})
    path = tmp_path / "t.jsonl"
    path.write_text(good + "\n" + good.replace("[7, 2]", '["7", 2]') + "\n")
    with pytest.raises(TraceError, match=r"line 2: completion_ids\[0\] must be a non-empty list of token ids"):
        load_problems(str(path))
    path.write_text(good + "\n" + good.replace('"completions": ["x", "y"]', '"completions": ["x"]') + "\n")
    with pytest.raises(TraceError, match="line 2: 2 completion_ids but 1 completions"):
        load_problems(str(path))
    path.write_text(good[:40] + "\n" + good + "\n")
    with pytest.raises(TraceError, match="line 1: not valid JSON"):
        load_problems(str(path))
    path.write_text(good + "\n" + good[:40])  # an interrupted write: the last line is dropped
    messages = []
    (p,) = load_problems(str(path), log=messages.append)
    assert p.completions == [[7, 2], [8, 2]]
    assert any("line 2" in m and "truncated" in m for m in messages)
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"prompt": "q", "completions": ["x", "y"]}) + "\n")
    with pytest.raises(TraceError, match="line 1: text without token ids"):
        load_problems(str(text))
    with pytest.raises(TraceError, match="tokenizer not found"):  # loaded when a text line needs it
        load_problems(str(text), TraceTokenizer(str(tmp_path / "no-tokenizer.json")))


@pytest.mark.slow
@pytest.mark.vllm
def test_record_writes_traces_that_resume_and_replay(tmp_path, monkeypatch, capsys):
    from evals.math import record

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as the CLI runs on CPU
    out = tmp_path / "rec.jsonl"
    common = ["--out", str(out), "--n", "2", "--max-tokens", "24", "--logprobs", "--dtype", "float32",
              "--max-model-len", "256", "--gpu-memory-utilization", "0.2", "--batch-size", "2"]
    assert record.main(common + ["--limit", "2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["synthetic-0", "synthetic-1"]
    for r in rows:
        assert {"id", "prompt", "completions", "answer", "model", "temperature", "source", "prompt_ids",
                "completion_ids", "logprobs", "answers", "gold", "meta"} <= set(r)
        assert len(r["completions"]) == len(r["completion_ids"]) == len(r["answers"]) == 2
        assert [len(x) for x in r["logprobs"]] == [len(x) for x in r["completion_ids"]]
        assert all(lp <= 0 for x in r["logprobs"] for lp in x)
        assert r["meta"]["n"] == 2 and r["meta"]["max_tokens"] == 24 and r["meta"]["vllm"]
        assert r["meta"]["eos_token_id"] == 2 and r["answer"] == r["gold"]
    # an interrupted write: the resumed run drops the cut line and records it again
    text = out.read_text()
    out.write_text(text[:len(text) - 30])
    capsys.readouterr()
    assert record.main(common + ["--limit", "3"]) == 0
    assert "line 2 is truncated" in capsys.readouterr().err
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == \
        ["synthetic-0", "synthetic-1", "synthetic-2"]
    assert record.main(common + ["--limit", "3", "--n", "3"]) == 2  # other settings: refused
    assert "recorded with n=2" in capsys.readouterr().err
    assert [p.id for p in load_problems(str(out))] == ["synthetic-0", "synthetic-1", "synthetic-2"]
