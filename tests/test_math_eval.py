"""``python -m evals math``: argument errors, dataset loading, gold answers,
prompts and reporting (fast, no engine), plus one end-to-end run on a tiny
random Llama (slow)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import math_verify  # noqa: F401 - declared dependency: answers are graded with it
import pytest

from evals.math import configs, llm, math as math_eval  # noqa: E402
from evals.math.datasets import (  # noqa: E402
    HUB,
    DatasetError,
    MathProblem,
    gold_answer,
    load_problems,
)
from evals.math.prompts import MATH_INSTRUCTION, build_prompt  # noqa: E402
from consensus_spec.sampling.stopping import StopRule  # noqa: E402
from consensus_spec.sampling.waves import Schedule  # noqa: E402
from evals.math import report as math_report  # noqa: E402


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def small_jsonl(tmp_path):
    return write_jsonl(tmp_path / "small.jsonl", [
        {"question": "one plus two is", "answer": "one plus two makes three\n#### 3"},
        {"question": "How many cents in $12.34?", "answer": "#### 1,234"},
        {"question": "two times four is", "answer": "#### 8"},
    ])


@pytest.fixture
def fake_model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return str(d)


# ---------------------------------------------------------------------------
# Bad arguments: one error line, exit code 2, no traceback, no engine
# ---------------------------------------------------------------------------


def run_main(argv, capsys):
    rc = math_eval.main(argv)
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize("argv,message", [
    (["--dataset", "nope"], "unknown dataset 'nope'"),
    (["--dataset", "/definitely/not/here.jsonl"], "dataset file not found"),
    (["--n", "0"], "--n must be >= 1"),
    (["--n", "4", "0"], "--n must be >= 1"),
    (["--methods", "none", "medusa"], "unknown method 'medusa'"),
    (["--model", "/definitely/not/a/model_dir"], "model directory not found"),
    (["--n", "two"], "invalid int value"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--k", "0"], "--k must be >= 1"),
    (["--scouts", "1"], "--scouts was removed: --scouts S is --waves S,rest"),
    (["--early-stop", "soon"], "--early-stop expects"),
    (["--early-stop", "predictive:2"], "StopRule.error"),
    (["--early-stop", "window:1"], "StopRule.window"),
    (["--early-stop", "decided:3"], "--early-stop expects"),
    (["--early-stop", "-1"], "--early-stop expects"),
    (["--waves", "0,rest"], "--waves expects"),
    (["--waves", "rest,4"], "--waves expects"),
    (["--waves", "four"], "--waves expects"),
    (["--waves", "all", "--early-stop"], "no configuration left"),
    (["--capacity", "0"], "--capacity must be >= 1"),
    (["--check", "step"], "invalid choice"),
    (["--option", "no_such_option=1"], "bad --option"),
    (["--bogus-flag"], "unrecognized arguments"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message, small_jsonl, fake_model, capsys):
    base = ["--dataset", small_jsonl, "--model", fake_model]
    rc, err = run_main(base + argv, capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0]
    assert "Traceback" not in err


def test_model_dir_without_config_and_missing_embedded_model(tmp_path, small_jsonl, capsys, monkeypatch):
    rc, err = run_main(["--dataset", small_jsonl, "--model", str(tmp_path)], capsys)
    assert rc == 2 and "has no config.json" in err
    import consensus_spec.model as embedded
    monkeypatch.setattr(embedded, "MODEL_DIR", tmp_path / "absent")
    rc, err = run_main(["--dataset", small_jsonl], capsys)
    assert rc == 2 and "embedded model not found" in err and "--model" in err


def test_hub_ids_are_passed_through(fake_model):
    assert llm.resolve_model("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"
    assert llm.resolve_model(fake_model) == fake_model
    with pytest.raises(configs.UsageError):
        llm.resolve_model("./not/here")


def test_parse_args_normalises_lists(small_jsonl):
    args = math_eval.parse_args(["--dataset", small_jsonl, "--n", "16", "4", "4",
                                 "--methods", "consensus", "none", "consensus",
                                 "--early-stop", "--waves", "all", "1,rest"])
    assert args.n == [4, 16]
    assert args.methods == ["consensus", "none"]
    assert args.early_stop == [StopRule()]
    assert [s.waves for s in args.waves] == [("rest",), (1, "rest")]
    assert math_eval.parse_args([]).early_stop == [None]
    assert configs.parse_early_stop(["off", "decided", "2", "on", "predictive:0.1", "window:5",
                                       "margin:4", "beta"]) == [
        None, StopRule(kind="decided"), StopRule(kind="margin", margin=2, min_samples=1),
        StopRule(), StopRule(kind="predictive", error=0.1), StopRule(kind="window", window=5),
        StopRule(kind="margin", margin=4), StopRule(kind="beta")]
    assert configs.parse_waves(None) == ["auto"]
    parsed = configs.parse_waves(["auto", "all", "1,2,4,rest", "4", "4+no-fill"])
    assert parsed[0] == "auto"
    assert [(s.waves, s.fill_idle) for s in parsed[1:]] == [
        (("rest",), True), ((1, 2, 4, "rest"), True), ((4,), True), ((4,), False)]


def test_configs_pair_plain_and_adaptive_runs():
    args = math_eval.parse_args(["--n", "16", "--early-stop", "off", "on"])
    assert [(n, s, r) for n, s, r in args.configs] == [
        (16, Schedule(waves=("rest",)), None), (16, Schedule(), StopRule())]
    args = math_eval.parse_args(["--n", "8", "16", "--waves", "auto", "2,rest", "--early-stop",
                                 "off", "decided", "--check", "path", "--capacity", "64"])
    got = [(n, s.describe(), s.capacity, configs.early_stop_label(r)) for n, s, r in args.configs]
    assert got == [(n, w, 64, e) for n in (8, 16) for w, e in (
        ("all", "off"), ("2+path-check", "decided"), ("2,rest", "off"),
        ("2,rest+path-check", "decided"))]
    # all at once can only stop with per-path checks; the useless combination is skipped
    args = math_eval.parse_args(["--waves", "all", "4,rest", "--early-stop", "on"])
    assert [s.describe() for _, s, _ in args.configs] == ["4,rest"]


def test_spec_configs(small_jsonl):
    args = math_eval.parse_args(["--k", "5", "--ngram-lookup", "2", "4", "--option", "min_prob=0.3"])
    assert llm.spec_config("none", args) is None
    assert llm.spec_config("ngram", args) == {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert llm.spec_config("suffix", args) == {"method": "suffix", "num_speculative_tokens": 5}
    cfg = llm.spec_config("consensus", args)
    assert cfg == {"method": "custom_class", "model": "consensus_spec.ConsensusProposer",
                   "num_speculative_tokens": 5}
    assert llm.engine_options("consensus", args) == {"consensus_spec": {"min_prob": 0.3}}
    assert llm.engine_options("ngram", args) == {}


# ---------------------------------------------------------------------------
# Datasets and gold answers
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("value,field,expected", [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "answer", "72"),
    ("#### 1,234", "answer", "1234"),
    ("#### -5", "answer", "-5"),
    ("#### 3.5", "answer", "3.5"),
    (r"\frac{14}{3}", "answer", r"\frac{14}{3}"),
    (r"\left( 3, \frac{\pi}{2} \right)", "answer", r"\left( 3, \frac{\pi}{2} \right)"),
    (" 204 ", "answer", "204"),
    (42, "answer", "42"),
    (7.0, "answer", "7"),
    (r"So $x = 2$, hence $\boxed{\dfrac{1}{2}}$.", "solution", r"\dfrac{1}{2}"),
    ("The answer is 17.", "solution", "17"),
])
def test_gold_answer(value, field, expected):
    assert gold_answer(value, field) == expected


def test_gold_keys_match_equivalent_predictions():
    from consensus_spec.voting.answers import answers_equal
    assert MathProblem("0", "q", gold_answer("#### 1,234")).gold_key == "1234"
    assert answers_equal(r"\boxed{1,234}"[7:-1], gold_answer("#### 1,234"))
    assert answers_equal("0.5", gold_answer(r"\boxed{\frac{1}{2}}", "solution"))


def test_load_local_jsonl(small_jsonl):
    probs = load_problems(small_jsonl)
    assert [p.gold for p in probs] == ["3", "1234", "8"]
    assert probs[0].question == "one plus two is" and probs[0].kind == "math"
    assert [p.id for p in probs] == ["0", "1", "2"]
    assert len(load_problems(small_jsonl, limit=2)) == 2


def test_load_other_fields_and_formats(tmp_path):
    rows = [{"id": "a", "problem": "Compute 1/2 + 0", "solution": r"It is $\boxed{\frac12}$."},
            {"id": "b", "problem": "2+2", "answer": 4}]
    probs = load_problems(write_jsonl(tmp_path / "mixed.jsonl", rows))
    assert [(p.id, p.gold) for p in probs] == [("a", r"\frac12"), ("b", "4")]
    path = tmp_path / "list.json"
    path.write_text(json.dumps([{"question": "q", "answer": "#### 9"}]))
    assert load_problems(str(path))[0].gold == "9"


def test_load_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = str(tmp_path / "set.parquet")
    pq.write_table(pa.table({"problem": ["1+1", "2+3"], "answer": ["2", "5"]}), path)
    assert [p.gold for p in load_problems(path)] == ["2", "5"]


def test_bad_files(tmp_path):
    with pytest.raises(DatasetError, match="needs a question field"):
        load_problems(write_jsonl(tmp_path / "x.jsonl", [{"text": "hello"}]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DatasetError):
        load_problems(str(empty))
    with pytest.raises(DatasetError, match="unsupported dataset file"):
        (tmp_path / "data.csv").write_text("a,b\n")
        load_problems(str(tmp_path / "data.csv"))


def test_synthetic_set():
    from consensus_spec.model.synthetic import test_set
    probs = load_problems("synthetic", limit=5)
    ref = test_set(5)
    assert [p.gold for p in probs] == [str(r["answer"]) for r in ref]
    assert all(p.kind == "synthetic" for p in probs)


# Rows in the layouts of ../shared/data/math/ (see its README), made up here: the named
# sets are read from that folder, which a clone may lack, so the test points it at these.
SHARED_LAYOUTS = {
    "gsm8k": [{"question": f"Ann has {i} pens and buys {i + 2} more. How many pens does she have?",
               "answer": f"She has {i} + {i + 2} = {2 * i + 2} pens.\n#### {2 * i + 2:,}"}
              for i in (1, 4, 7, 600, 9)],
    "math500": [{"problem": f"Compute $\\frac{{{i}}}{{3}}$.", "solution": f"It is $\\boxed{{\\frac{{{i}}}{{3}}}}$.",
                 "answer": f"\\frac{{{i}}}{{3}}", "subject": "Algebra", "level": 1,
                 "unique_id": f"test/algebra/{i}.json"} for i in range(1, 6)],
    "aime2024": [{"id": 60 + i, "problem": f"Find the remainder when $7^{i}$ is divided by 1000.",
                  "solution": f"... so the answer is $\\boxed{{{7 ** i % 1000}}}$.",
                  "answer": str(7 ** i % 1000)} for i in range(1, 6)],
}


@pytest.mark.parametrize("name", ["gsm8k", "math500", "aime2024"])
def test_shared_sets(name, tmp_path, monkeypatch):
    import evals.math.datasets

    write_jsonl(tmp_path / HUB[name][0], SHARED_LAYOUTS[name] * 2)
    monkeypatch.setattr(evals.math.datasets, "SHARED_MATH", str(tmp_path))
    probs = load_problems(name, limit=5)
    assert len(probs) == 5 and all(p.question and p.gold for p in probs)
    if name == "gsm8k":
        assert all(p.gold.lstrip("-").replace(".", "").isdigit() for p in probs)
        assert "####" not in probs[0].gold and probs[3].gold == "1202"  # thousands comma dropped
    if name == "math500":
        assert probs[0].gold == "\\frac{1}{3}" and probs[0].id == "test/algebra/1.json"
    if name == "aime2024":
        assert [p.gold for p in probs] == ["7", "49", "343", "401", "807"] and probs[0].id == "61"


# ---------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------


class FakeTokenizer:
    bos_token, bos_token_id = "<s>", 1

    def __init__(self, chat_template=None, adds_bos=True):
        self.chat_template = chat_template
        self.adds_bos = adds_bos

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "<s>[USER]" + messages[0]["content"] + "[/USER]"

    def __call__(self, text):
        return SimpleNamespace(input_ids=([1] if self.adds_bos else []) + [5])


def test_prompts():
    prob = MathProblem("0", "What is 2+2?", "4")
    plain = build_prompt(prob, FakeTokenizer())
    assert plain.startswith(MATH_INSTRUCTION) and plain.endswith("Question: What is 2+2?\nAnswer:")
    assert "\\boxed{}" in plain
    chat = build_prompt(prob, FakeTokenizer(chat_template="{{ x }}"))
    assert chat.startswith("[USER]") and "What is 2+2?" in chat  # BOS not doubled
    chat_keep = build_prompt(prob, FakeTokenizer(chat_template="{{ x }}", adds_bos=False))
    assert chat_keep.startswith("<s>[USER]")
    from consensus_spec.model.synthetic import format_prompt
    synth = MathProblem("s", "Mia has 3 apples.", "3", "synthetic")
    assert build_prompt(synth, FakeTokenizer(chat_template="x")) == format_prompt("Mia has 3 apples.")


# ---------------------------------------------------------------------------
# Scoring and reporting
# ---------------------------------------------------------------------------


def fake_result(answers, voted, stopped=False):
    samples = [SimpleNamespace(answer=a) for a in answers]
    return SimpleNamespace(samples=samples, answer=voted, agreement=0.5, stopped_early=stopped,
                           num_tokens=10 * len(answers), num_aborted=0)


def test_score_pass1_and_majority():
    probs = [MathProblem("0", "q", "0.5"), MathProblem("1", "q", "3")]
    run = [fake_result([r"\frac{1}{2}", "0.5", "2", None], r"\frac{1}{2}"),
           fake_result(["4", "4"], "4")]
    acc = math_report.score(run, probs)
    assert acc["pass_at_1"] == pytest.approx((2 / 4 + 0) / 2)
    assert acc["maj_at_n"] == 0.5
    assert acc["per_problem"][0]["correct"] and not acc["per_problem"][1]["correct"]


def problem(i, answer, answers=None, gold="1"):
    answers = answers if answers is not None else [answer]
    return dict(id=str(i), gold=gold, answer=answer, answers=answers,
                sample_tokens=[10] * len(answers))


def make_rows():
    base = dict(waves="all", early_stop="off", problems=2, pass_at_1=0.5, maj_at_n=0.5,
                mean_acceptance_length=None, drafted_tokens=0, accepted_tokens=0, est_tokens_saved=0,
                _stop_rule=None, wave_sizes=[4], check="wave")
    plain_pp = [problem(0, "1", ["1", "1", "1", "2"]), problem(1, "2", ["2", "3", "2", "3"])]
    adaptive = dict(base, waves="2,rest", early_stop="decided", _stop_rule=StopRule(kind="decided"),
                    wave_sizes=[2, 2], method="consensus", n=4, tokens=60, wall_time_s=3.0,
                    tokens_per_s=20.0, per_problem=[problem(0, "1.0"), problem(1, "3")])
    return [dict(base, method="none", n=4, tokens=100, wall_time_s=10.0, tokens_per_s=10.0,
                 per_problem=plain_pp),
            dict(base, method="consensus", n=4, tokens=120, wall_time_s=6.0, tokens_per_s=20.0,
                 mean_acceptance_length=2.5, drafted_tokens=80, accepted_tokens=30,
                 per_problem=[problem(0, "1"), problem(1, "3")]),
            adaptive,
            dict(base, method="consensus", n=8, tokens=200, wall_time_s=8.0, tokens_per_s=25.0,
                 per_problem=plain_pp)]


def test_comparisons_table_and_plots(tmp_path):
    rows = make_rows()
    math_report.add_comparisons(rows)
    none, cons, adaptive, cons8 = rows
    assert none["speedup"] == 1.0 and none["wall_speedup"] == 1.0
    assert cons["speedup"] == pytest.approx(2.0) and cons["wall_speedup"] == pytest.approx(10 / 6)
    assert adaptive["speedup"] is None  # no `none` run with these waves and rule
    assert adaptive["wall_speedup"] == pytest.approx(10 / 3)  # vs plain none
    assert adaptive["tokens_vs_plain"] == pytest.approx(60 / 120)  # vs plain consensus
    # "1.0" equals "1" (math-verify); "3" vs "3": both agree with plain consensus
    assert adaptive["agreement"] == 1.0 and cons["agreement"] is None
    # replayed on plain consensus: problem 0 ["1"], problem 1 ["3"]: one sample each, nothing to stop
    assert adaptive["replay_agreement"] == 1.0 and adaptive["replay_tokens"] == 1.0
    assert cons8["speedup"] is None and cons8["wall_speedup"] is None  # no plain none at n=8
    assert math_report.noise_floor(rows) == [("none", "consensus", 4, 0.5)]
    table = math_report.markdown(rows)
    assert table.count("\n| ") == 4 and "| consensus | 4 | 2,rest | decided |" in table
    assert "none vs consensus (n=4) 0.500" in table
    points = math_report.tradeoff(rows, rules=["decided", "predictive:0.2"])
    assert {(p["method"], p["n"], p["waves"], p["rule"]) for p in points} == {
        (m, n, "2,rest", r) for m, n in (("none", 4), ("consensus", 4), ("consensus", 8))
        for r in ("decided", "predictive(error=0.2, min=3)")}
    md = math_report.tradeoff_markdown(points)
    assert md.count("\n") == len(points) + 1
    assert math_report.plot(rows, str(tmp_path / "p.png"))
    assert math_report.plot_tradeoff(rows, points, str(tmp_path / "t.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000 and (tmp_path / "t.png").stat().st_size > 1000


def test_replay_measures_stopping_error_on_plain_samples():
    # problem 0: unanimous -> predictive stops after the first wave of 4 (4/16 of the tokens);
    # problem 1: 10-6 for "2", but the first wave of 4 is unanimous for "1"
    unanimous = ["5"] * 16
    misleading = ["1"] * 6 + ["2"] * 2 + ["2"] * 8
    plain = dict(per_problem=[
        dict(id="0", gold="5", answer="5", answers=unanimous, sample_tokens=[10] * 16),
        dict(id="1", gold="2", answer="2", answers=misleading, sample_tokens=[10] * 16)],
        maj_at_n=1.0)
    exact = math_report.replay(plain, [4, 4, 8], StopRule(kind="decided"))
    assert exact["agreement"] == 1.0 and exact["maj"] == 1.0
    rep = math_report.replay(plain, [4, 4, 8], StopRule())
    assert rep["tokens_frac"] == pytest.approx((4 + 4) / 32)
    assert rep["agreement"] == 0.5 and rep["maj"] == 0.5  # problem 1 stopped on the wrong leader
    per_path = math_report.replay(plain, [16], StopRule(), check="path")
    assert per_path["tokens_frac"] <= rep["tokens_frac"]


# ---------------------------------------------------------------------------
# End to end on a tiny random Llama (slow: two vLLM engines)
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.vllm
def test_cli_end_to_end_on_tiny_llama(tmp_path, small_jsonl, capsys, monkeypatch):
    from tests.tiny_model import build_tiny_llama

    # engines in this process, as the CLI runs them on CPU: two in a row, after
    # numba is loaded (vllm_compat makes that work); the KV budget then counts
    # this process's own memory too, hence the larger utilization
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = build_tiny_llama(str(tmp_path / "tiny"))
    out = tmp_path / "res" / "math"
    rc = math_eval.main(["--dataset", small_jsonl, "--model", model, "--n", "2", "--limit", "2",
                         "--methods", "none", "consensus", "--max-tokens", "16",
                         "--dtype", "float32", "--gpu-memory-utilization", "0.2",
                         "--max-model-len", "256", "--out", str(out)])
    assert rc == 0
    data = json.loads((tmp_path / "res" / "math.json").read_text())
    rows = {r["method"]: r for r in data["results"]}
    assert set(rows) == {"none", "consensus"} and data["num_problems"] == 2
    for r in rows.values():
        for key in ("pass_at_1", "maj_at_n", "tokens_per_s", "wall_time_s", "mean_acceptance_length",
                    "drafted_tokens", "accepted_tokens", "speedup", "tokens"):
            assert key in r
        assert r["n"] == 2 and r["tokens"] > 0 and r["wall_time_s"] > 0
        assert 0 <= r["pass_at_1"] <= 1 and 0 <= r["maj_at_n"] <= 1
        assert len(r["per_problem"]) == 2 and all(p["samples"] == 2 for p in r["per_problem"])
    assert rows["none"]["speedup"] == 1.0 and rows["none"]["drafted_tokens"] == 0
    assert rows["consensus"]["drafted_tokens"] > 0 and rows["consensus"]["speedup"] > 0
    assert rows["consensus"]["mean_acceptance_length"] >= 1.0
    assert (tmp_path / "res" / "math.md").read_text().count("| consensus |") == 1
    assert (tmp_path / "res" / "math.png").exists()
    assert "| none |" in capsys.readouterr().out


def test_waves_simulation_on_plain_samples(tmp_path, capsys):
    from evals.adaptive import waves_sim
    rng = __import__("random").Random(0)
    per_problem = []
    for i in range(12):
        share = 1.0 if i % 2 else 0.5
        answers = ["7" if rng.random() < share else str(rng.randint(1, 5)) for _ in range(16)]
        per_problem.append(dict(id=str(i), gold="7", answer="7", answers=answers,
                                sample_tokens=[rng.randint(5, 30) for _ in range(16)]))
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"results": [dict(method="none", n=16, waves="all", early_stop="off",
                                                 per_problem=per_problem)]}))
    assert waves_sim.main([str(path), "--waves", "4,4,rest", "all", "--rules", "on", "decided",
                           "--capacity", "32", "--perms", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 4,4,rest") or line.startswith("| all")]
    assert len(rows) == 4
    # all at once never stops: exactly the baseline; waves + predictive saves tokens
    assert rows[2].split("|")[3].strip() == "100.0"
    assert float(rows[0].split("|")[3]) < 100.0
