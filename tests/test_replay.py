"""The replay engine and its projection, through ``python -m evals replay``
on trace files the tests write: every recorded token is produced once, the
drafts are judged against the recorded future, and the figures are projected
on a step-cost table."""

import json
import os
import textwrap

import pytest

from tests.evals_cli import (STEP_COSTS, TRACES, char_tokenizer, ok, read_json, recorded_tokens, run_evals,
                             synthetic_problems, write_traces)

SETS = {"a": synthetic_problems(4, 6), "b": synthetic_problems(6, 6), "c": synthetic_problems(5, 7)}


def replay_args(*traces, methods=("none", "consensus"), batches=(8,), k=4, extra=()):
    return ["replay", "--traces", *traces, "--methods", *methods, "--batches", *map(str, batches), "--k", str(k),
            "--schedules", "fixed", "--sweep-k", "0", "--online", "off", "--repeats", "1", "--costs", STEP_COSTS,
            "--host-time", "none", *extra]


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    """{(set, batch, method, scouts): result} for sets a (4 x 6), b (6 x 6), c (5 x 7)
    at 8 and 3 rows, scouts 0 and 1."""
    tmp = tmp_path_factory.mktemp("replay")
    traces = [write_traces(tmp / f"{name}.jsonl", probs) for name, probs in SETS.items()]
    ok(run_evals(*replay_args(*traces, batches=(8, 3), extra=("--scouts", "0", "1", "--out", tmp / "r"))))
    return {(r["traces"], r["batch"], r["method"], r["scouts"]): r for r in read_json(tmp / "r.json")["results"]}


def test_no_drafting_takes_one_token_per_step(synthetic_run):
    s = synthetic_run[("a", 8, "none", 0)]
    total = recorded_tokens(SETS["a"])  # first token comes from prefill
    assert s["tokens"] == total and s["row_steps"] == total
    assert s["tau"] == 1.0 and s["drafted"] == 0


def test_consensus_reproduces_the_trace_and_accepts_sibling_text(synthetic_run):
    s = synthetic_run[("a", 8, "consensus", 0)]
    assert s["tokens"] == recorded_tokens(SETS["a"])  # every recorded token is produced exactly once
    assert s["tau"] > 1.5 and 0 < s["acceptance"] <= 1
    # each step yields accepted + 1 tokens, except a final step whose draft ran to EOS
    assert s["tokens"] - s["row_steps"] <= s["accepted"] <= s["tokens"]


def test_scouts_let_followers_draft_from_finished_siblings(synthetic_run):
    s0, s1 = synthetic_run[("b", 8, "consensus", 0)], synthetic_run[("b", 8, "consensus", 1)]
    assert s1["tokens"] == s0["tokens"]
    assert s1["tau"] > s0["tau"]


def test_condense_keeps_rows_consistent_with_small_batches(synthetic_run):
    s = synthetic_run[("c", 3, "consensus", 0)]
    assert s["tokens"] == recorded_tokens(SETS["c"])


def test_bad_trace_files_give_clear_errors_or_skips(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = run_evals(*replay_args(empty, extra=("--out", tmp_path / "r")))
    assert out.returncode == 2 and "no replayable problems" in out.stderr
    out = run_evals(*replay_args(tmp_path / "missing.jsonl", extra=("--out", tmp_path / "r")))
    assert out.returncode == 2 and "not found" in out.stderr
    mixed = tmp_path / "mixed.jsonl"
    rows = [
        {"prompt": "q1", "completions": ["only one"]},
        {"prompt": "q2", "completions": ["", "a", "b"]},
        {"prompt": "", "completions": ["a", "b"]},
        "not json",
    ]
    mixed.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows))
    tokenizer = char_tokenizer(tmp_path / "chars.json")
    args = replay_args(mixed, methods=("none",), extra=("--tokenizer", tokenizer, "--out", tmp_path / "r"))
    out = run_evals(*args)  # a bad line is an error naming it ...
    assert out.returncode == 2 and f"{mixed}, line 4: not valid JSON" in out.stderr and "Traceback" not in out.stderr
    out = run_evals(*args, "--skip-bad-lines")  # ... unless skipped: then counted, as unusable entries are
    assert ok(out) and "Traceback" not in out.stderr
    assert "mixed.jsonl: skipped 1 line(s) not a JSON object: 4" in out.stderr
    assert "mixed.jsonl: skipped 1 entry: fewer than 2 non-empty completions" in out.stderr
    assert "mixed.jsonl: skipped 1 entry: no prompt or completions" in out.stderr
    (r,) = read_json(tmp_path / "r.json")["results"]
    # only line 2 is replayed, its empty completion dropped: "a" and "b" (+ EOS), one token each after prefill
    assert r["problems"] == 1 and r["tokens"] == r["row_steps"] == 2


def test_cli_reports_errors_without_traceback(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = run_evals("replay", "--traces", str(empty), "--methods", "consensus", "--costs", STEP_COSTS,
                    "--host-time", "none", "--out", str(tmp_path / "r"))
    assert out.returncode == 2
    assert "no replayable problems" in out.stderr and "Traceback" not in out.stderr


def test_projection_matches_the_formula(tmp_path):
    """A saved result projected afresh (--from-json) on a three-entry cost table."""
    costs = tmp_path / "costs.jsonl"
    costs.write_text("".join(json.dumps({"B": 16, "q": q, "ms": ms}) + "\n"
                             for q, ms in ((1, 10.0), (2, 11.0), (3, 13.0))))
    base = {"traces": "t", "problems": 1, "scouts": 0, "run": 0, "tau": 2.0, "drafts_per_step": 1.5,
            "cpu_us_per_row": 100.0}
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"results": [{**base, "method": "consensus", "batch": 16},
                                             {**base, "method": "consensus", "batch": 64}]}))
    ok(run_evals("replay", "--from-json", saved, "--costs", costs, "--host-time", "none", "--out", tmp_path / "p"))
    at16, at64 = read_json(tmp_path / "p.json")["results"]
    # T(16, 2.5) = 12 between the table's rows; tau 2, 100 µs per row over 16 rows = 1.6 ms
    assert at16["speedup"] == pytest.approx(2.0 * 10.0 / (12.0 + 1.6))
    assert "speedup" not in at64  # a batch size the table lacks is not projected
    assert at16["projected_over"] == "all steps"  # saved before steady steps were kept


def test_projection_at_a_batch_size_reads_its_steady_steps(tmp_path):
    """A run's draining tail drafts at smaller batches: the projection at B
    rows takes τ, drafts and drafter time from the steps run while paths still
    waited to enter, once there are enough of them, and says which it used."""
    costs = tmp_path / "costs.jsonl"
    costs.write_text("".join(json.dumps({"B": 16, "q": q, "ms": ms}) + "\n"
                             for q, ms in ((1, 10.0), (2, 11.0), (3, 13.0))))
    base = {"traces": "t", "problems": 1, "scouts": 0, "run": 0, "method": "consensus", "batch": 16,
            "tau": 1.2, "drafts_per_step": 2.0, "cpu_us_per_row": 500.0}
    full = {"tau": 2.0, "drafts_per_step": 1.5, "cpu_us_per_row": 100.0}
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"results": [{**base, "steady": {**full, "steps": 20}},
                                             {**base, "traces": "few", "steady": {**full, "steps": 19}}]}))
    ok(run_evals("replay", "--from-json", saved, "--costs", costs, "--host-time", "none", "--out", tmp_path / "p"))
    enough, few = read_json(tmp_path / "p.json")["results"]
    assert enough["projected_over"] == "steady steps"
    assert enough["speedup"] == pytest.approx(2.0 * 10.0 / (12.0 + 1.6))
    assert few["projected_over"] == "all steps"  # 19 steady steps: every step counted
    assert few["speedup"] == pytest.approx(1.2 * 10.0 / (13.0 + 8.0))


def test_steady_steps_end_where_the_batch_starts_to_drain():
    from evals.replay.engine import ReplayStats
    stats = ReplayStats("consensus", 0, step_rows=[4, 4, 3, 2, 1], step_drafted=[8, 4, 3, 0, 0],
                        step_tokens=[12, 8, 6, 2, 1], drain_step=2)
    assert stats.steady() == {"steps": 2, "tau": 20 / 8, "drafts_per_step": 12 / 8}
    stats.drain_step = None  # never drained (the batch ran full to the end)
    assert stats.steady()["steps"] == 5


FLOOR_OFF = """
    import os

    if os.environ.get("FLOOR_LOG"):  # the budget's floor noted, then ignored (0: nothing pruned)
        from consensus_spec.budget import DraftBudget

        _real = DraftBudget.floor

        def floor(self, b):
            with open(os.environ["FLOOR_LOG"], "a") as f:
                f.write(f"{_real(self, b)}\\n")
            return 0.0

        DraftBudget.floor = floor
"""


@pytest.fixture(scope="module")
def fixture_run(tmp_path_factory):
    """The recorded fixture (16 x 8 paths: one batch of 128 rows) replayed
    with a tokenizer file that cannot load: (results by method, stderr)."""
    tmp = tmp_path_factory.mktemp("recorded")
    bogus = tmp / "not-a-tokenizer.json"
    bogus.write_text("not a tokenizer")
    out = run_evals(*replay_args(TRACES, batches=(128,), k=8, extra=("--tokenizer", bogus, "--out", tmp / "r")))
    ok(out)
    return {r["method"]: r for r in read_json(tmp / "r.json")["results"]}, bogus


def test_budget_floor_only_skips_drafting_that_could_not_pay(fixture_run, tmp_path):
    """The drafter stops walking below the budget's floor; what it sends must
    be exactly what the budget would have kept from full-length drafts."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(FLOOR_OFF))
    log = tmp_path / "floors.txt"
    ok(run_evals(*replay_args(TRACES, methods=("consensus",), batches=(128,), k=8, extra=("--out", tmp_path / "r")),
                 env={"PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                      "FLOOR_LOG": str(log)}))
    full = read_json(tmp_path / "r.json")["results"][0]
    pruned = fixture_run[0]["consensus"]
    assert max(float(x) for x in log.read_text().split()) > 0.1  # the floor did prune at this batch size
    assert (pruned["tokens"], pruned["row_steps"], pruned["drafted"], pruned["accepted"]) == \
        (full["tokens"], full["row_steps"], full["drafted"], full["accepted"])


def test_drafter_time_is_reported_with_its_tail(fixture_run):
    """The referee's drafter time: median and p99 over calls, and over the
    calls with a full batch (128 rows: the fixture's paths all at once)."""
    r = fixture_run[0]["consensus"]
    assert 0 < r["cpu_median_us_per_row"] <= r["cpu_p99_us_per_row"]
    full = r["cpu_full_batch_us_per_row"]
    assert full["calls"] >= 1 and 0 < full["median"] <= full["p99"]


# --- recorded traces (python -m evals record) --------------------------------


def test_recorded_ids_replay_without_a_tokenizer(fixture_run, tmp_path):
    rows = [json.loads(line) for line in open(TRACES)]
    none = fixture_run[0]["none"]
    for r in rows:
        assert len(r["completions"]) == len(r["completion_ids"]) == len(r["answers"]) == 8
    # replayed as recorded (no tokenizer: the one given cannot load): every path
    # ends with EOS, added where the recorded ids stopped at the length limit
    assert none["problems"] == len(rows) == 16
    assert none["tokens"] == none["row_steps"] == sum(
        len(ids) + (why != "stop") - 1 for r in rows for ids, why in zip(r["completion_ids"], r["finish_reasons"]))
    assert all(ids[-1] == r["meta"]["eos_token_id"] for r in rows
               for ids, why in zip(r["completion_ids"], r["finish_reasons"]) if why == "stop")
    # the recorded texts tokenize to their ids without loading a tokenizer (the stopping
    # and waves replays count tokens through encode_batch): stop-rules runs with it
    out = run_evals("stop-rules", "--traces", TRACES, "--limit", "2", "--perms", "1", "--tokenizer", fixture_run[1],
                    "--out", tmp_path / "s.json")
    assert ok(out) is not None and "Traceback" not in out.stderr


def test_bad_recorded_files_name_the_line(tmp_path):
    def replay(path, **kw):
        return run_evals(*replay_args(path, methods=("none",), extra=("--out", tmp_path / "r")), **kw)

    good = json.dumps({"id": "a", "prompt": "q", "completions": ["x", "y"], "prompt_ids": [1, 5],
                       "completion_ids": [[7, 2], [8]], "meta": {"eos_token_id": 2}})
    path = tmp_path / "t.jsonl"
    path.write_text(good + "\n" + good.replace("[7, 2]", '["7", 2]') + "\n")
    out = replay(path)
    assert out.returncode == 2
    assert "line 2: completion_ids[0] must be a non-empty list of token ids" in out.stderr
    path.write_text(good + "\n" + good.replace('"completions": ["x", "y"]', '"completions": ["x"]') + "\n")
    out = replay(path)
    assert out.returncode == 2 and "line 2: 2 completion_ids but 1 completions" in out.stderr
    path.write_text(good[:40] + "\n" + good + "\n")
    out = replay(path)
    assert out.returncode == 2 and f"{path}, line 1: not valid JSON" in out.stderr
    path.write_text(good + "\n" + good[:40])  # an interrupted write: a bad line like any other
    out = replay(path)
    assert out.returncode == 2 and f"{path}, line 2: not valid JSON" in out.stderr
    out = run_evals(*replay_args(path, methods=("none",), extra=("--out", tmp_path / "r", "--skip-bad-lines")))
    ok(out)
    assert "t.jsonl: skipped 1 line(s) not a JSON object: 2" in out.stderr
    (r,) = read_json(tmp_path / "r.json")["results"]
    assert r["problems"] == 1 and r["tokens"] == 2  # [7, 2] and [8, 2]: one token each after prefill
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"prompt": "q", "completions": ["x", "y"]}) + "\n")
    out = run_evals(*replay_args(text, methods=("none",), extra=(
        "--tokenizer", tmp_path / "no-tokenizer.json", "--out", tmp_path / "r")))
    assert out.returncode == 2 and "tokenizer not found" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
@pytest.mark.vllm
def test_record_writes_traces_that_resume_and_replay(tmp_path):
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # as the CLI runs on CPU
    out = tmp_path / "rec.jsonl"
    common = ["--out", str(out), "--n", "2", "--max-tokens", "24", "--logprobs", "--dtype", "float32",
              "--max-model-len", "256", "--gpu-memory-utilization", "0.2", "--batch-size", "2"]
    ok(run_evals("record", *common, "--limit", "2", env=env))
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
    again = run_evals("record", *common, "--limit", "3", env=env)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "line 2 is truncated" in again.stderr
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == \
        ["synthetic-0", "synthetic-1", "synthetic-2"]
    refused = run_evals("record", *common, "--limit", "3", "--n", "3", env=env)
    assert refused.returncode == 2  # other settings: refused
    assert "recorded with n=2" in refused.stderr
    ok(run_evals(*replay_args(out, methods=("none",), extra=("--out", tmp_path / "r"))))
    assert read_json(tmp_path / "r.json")["results"][0]["problems"] == 3
