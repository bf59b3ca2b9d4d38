"""``python -m evals math`` as a user runs it (tests/evals_cli.py): argument
errors, dataset loading, gold answers, prompts and configs through
``--dry-run``, reporting through ``--from-json`` on result rows the tests
write (fast, no engine), ``waves-sim``, plus one end-to-end run on a tiny
random Llama (slow).  No test imports the evals package."""

from __future__ import annotations

import json
import dataclasses
import os

import math_verify  # noqa: F401 - declared dependency: answers are graded with it
import pytest

from consensus_spec.sampling.stopping import StopRule  # noqa: E402
from consensus_spec.sampling.waves import Schedule  # noqa: E402
from evals.math import report  # noqa: E402
from tests.evals_cli import REPO, ok, run_evals

REPO_MODEL = os.path.join(REPO, "consensus_spec", "model")  # the embedded model
BARE_MODEL = None  # set by the bare_model fixture



def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def math_cli(*args, **kw):
    return run_evals("math", *args, **kw)


def dry_run(*args, model=None, **kw) -> dict:
    """``python -m evals math ARGS --dry-run``: what the run would do, as JSON;
    by default on a model folder without a tokenizer (plain prompts; loading
    a tokenizer costs seconds), ``model=""``: the embedded model."""
    model = BARE_MODEL if model is None else model
    return json.loads(ok(math_cli(*args, *(("--model", model) if model else ()), "--dry-run", **kw)))


@pytest.fixture(scope="module", autouse=True)
def bare_model(tmp_path_factory):
    """A model folder with a config and nothing else."""
    global BARE_MODEL
    d = tmp_path_factory.mktemp("bare_model")
    (d / "config.json").write_text("{}")
    BARE_MODEL = str(d)
    return BARE_MODEL


def usage_error(out) -> str:
    """The one ``error:`` line of a command that exited 2."""
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert "Traceback" not in out.stderr
    return lines[0]


def load_error(out) -> str:
    """The ``error:`` line of a command that exited 2 on a dataset it could not
    load (the ``datasets`` package may print progress lines before it)."""
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: ") and errors[0].strip() == out.stderr.strip().splitlines()[-1]
    assert out.stdout == ""
    return errors[0]


def rule(r):
    """A StopRule (or None) as the dry run prints it."""
    return None if r is None else dataclasses.asdict(r)


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
    (["--waves", "all", "--early-stop", "--check", "wave"], "no configuration left"),
    (["--capacity", "0"], "--capacity must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--check", "step"], "invalid choice"),
    (["--option", "no_such_option=1"], "bad --option"),
    (["--bogus-flag"], "unrecognized arguments"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message, small_jsonl, fake_model):
    # --dry-run as well: the error comes first, so nothing is printed and no engine starts
    out = math_cli("--dataset", small_jsonl, "--model", fake_model, *argv, "--dry-run")
    assert message in usage_error(out)
    assert out.stdout == ""


def test_model_dir_without_config_and_missing_embedded_model(tmp_path, small_jsonl):
    line = usage_error(math_cli("--dataset", small_jsonl, "--model", tmp_path, "--dry-run"))
    assert "has no config.json" in line
    # the embedded model's folder pointed elsewhere by a stand-in sitecustomize
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "sitecustomize.py").write_text(
        "import pathlib\nimport consensus_spec.model as embedded\n"
        f"embedded.MODEL_DIR = pathlib.Path({str(tmp_path / 'absent')!r})\n")
    env = {"PYTHONPATH": os.pathsep.join([str(stub), REPO])}
    line = usage_error(math_cli("--dataset", small_jsonl, "--dry-run", env=env))
    assert "embedded model not found" in line and "--model" in line
    embedded = dry_run("--dataset", small_jsonl, model="")
    assert embedded["model"] == REPO_MODEL and embedded["tokenizer_error"] is None


def test_hub_ids_are_passed_through(fake_model, small_jsonl):
    hub = dry_run("--dataset", small_jsonl, model="Qwen/Qwen2.5-1.5B-Instruct")
    assert hub["model"] == "Qwen/Qwen2.5-1.5B-Instruct"
    assert dry_run("--dataset", small_jsonl, model=fake_model)["model"] == fake_model
    assert "model directory not found" in usage_error(
        math_cli("--dataset", small_jsonl, "--model", "./not/here", "--dry-run"))


def test_parse_args_normalises_lists(small_jsonl):
    got = dry_run("--dataset", small_jsonl, "--n", "16", "4", "4",
                  "--methods", "consensus", "none", "consensus", "--early-stop", "--waves", "all", "1,rest")
    assert got["n"] == [4, 16]
    assert got["methods"] == ["consensus", "none"]
    assert got["early_stop"] == [rule(StopRule())]
    assert got["waves"] == [{"waves": ["rest"], "fill_idle": True}, {"waves": [1, "rest"], "fill_idle": True}]
    assert dry_run("--dataset", small_jsonl)["early_stop"] == [None]
    got = dry_run("--dataset", small_jsonl, "--early-stop", "off", "decided", "2", "on", "predictive:0.1",
                  "window:5", "margin:4", "beta")
    assert got["early_stop"] == [rule(r) for r in (
        None, StopRule(kind="decided"), StopRule(kind="margin", margin=2, min_samples=1),
        StopRule(), StopRule(kind="predictive", error=0.1), StopRule(kind="window", window=5),
        StopRule(kind="margin", margin=4), StopRule(kind="beta"))]
    assert dry_run("--dataset", small_jsonl)["waves"] == ["auto"]
    got = dry_run("--dataset", small_jsonl, "--early-stop", "--waves", "auto", "all", "1,2,4,rest", "4",
                  "4+no-fill")
    assert got["waves"] == ["auto"] + [{"waves": w, "fill_idle": f} for w, f in (
        (["rest"], True), ([1, 2, 4, "rest"], True), ([4], True), ([4], False))]


def configs(got):
    return [(c["n"], Schedule(waves=tuple(c["waves"]), capacity=c["capacity"], check=c["check"],
                              fill_idle=c["fill_idle"]),
             None if c["stop_rule"] is None else StopRule(**c["stop_rule"])) for c in got["configs"]]


def test_configs_pair_plain_and_adaptive_runs(small_jsonl):
    got = dry_run("--dataset", small_jsonl, "--n", "16", "--early-stop", "off", "on")
    assert configs(got) == [(16, Schedule(waves=("rest",)), None), (16, Schedule(), StopRule())]
    got = dry_run("--dataset", small_jsonl, "--n", "8", "16", "--waves", "auto", "2,rest", "--early-stop",
                  "off", "decided", "--check", "path", "--capacity", "64")
    assert [(c["n"], c["schedule"], c["capacity"], c["early_stop"]) for c in got["configs"]] == [
        (n, w, 64, e) for n in (8, 16) for w, e in (
            ("all", "off"), ("2+path-check", "decided"), ("2,rest", "off"), ("2,rest+path-check", "decided"))]
    assert [s.describe() for _, s, _ in configs(got)] == [c["schedule"] for c in got["configs"]]
    # all at once can stop only with per-path checks; with whole-wave ones it is skipped
    out = math_cli("--dataset", small_jsonl, "--waves", "all", "4,rest", "--early-stop", "on", "--dry-run",
                   "--check", "wave")
    assert [c["schedule"] for c in json.loads(ok(out))["configs"]] == ["4,rest+wave-check"]
    assert "note: skipping waves all+wave-check with early stop" in out.stderr
    out = math_cli("--dataset", small_jsonl, "--waves", "all", "--early-stop", "on", "--dry-run")
    assert [c["schedule"] for c in json.loads(ok(out))["configs"]] == ["all"]


def test_spec_configs(small_jsonl):
    got = dry_run("--dataset", small_jsonl, "--methods", "none", "ngram", "suffix", "consensus",
                  "--k", "5", "--ngram-lookup", "2", "4", "--option", "min_prob=0.3")
    spec, extra = got["speculative_config"], got["additional_config"]
    assert spec["none"] is None
    assert spec["ngram"] == {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert spec["suffix"] == {"method": "suffix", "num_speculative_tokens": 5}
    assert spec["consensus"] == {"method": "custom_class", "model": "consensus_spec.ConsensusProposer",
                                 "num_speculative_tokens": 5}
    assert extra["consensus"] == {"consensus_spec": {"min_prob": 0.3}}
    assert extra["ngram"] == {} and extra["none"] == {}
    # without --ngram-lookup, vLLM's defaults
    assert dry_run("--dataset", small_jsonl, "--methods", "ngram")["speculative_config"]["ngram"] == {
        "method": "ngram", "num_speculative_tokens": 8}


# ---------------------------------------------------------------------------
# Datasets and gold answers (loaded by --dry-run from files the tests write)
# ---------------------------------------------------------------------------

GOLD_CASES = [
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
]


@pytest.fixture(scope="module")
def gold_answers(tmp_path_factory):
    """{(value, field): gold}: one file per value type (a column holds one type)."""
    tmp = tmp_path_factory.mktemp("gold")
    got = {}
    groups = {}
    for value, field, _ in GOLD_CASES:
        groups.setdefault((type(value).__name__, field), []).append(value)
    for (typ, field), values in groups.items():
        path = write_jsonl(tmp / f"{typ}_{field}.jsonl", [{"question": f"q{i}", field: v} for i, v in enumerate(values)])
        problems = dry_run("--dataset", path)["problems"]
        assert [p["question"] for p in problems] == [f"q{i}" for i in range(len(values))]
        got.update({(v, field): p["gold"] for v, p in zip(values, problems)})
    return got


@pytest.mark.parametrize("value,field,expected", GOLD_CASES)
def test_gold_answer(value, field, expected, gold_answers):
    assert gold_answers[(value, field)] == expected


def test_gold_keys_match_equivalent_predictions(tmp_path):
    from consensus_spec.voting.answers import answers_equal
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "a", "answer": "#### 1,234"},
                                              {"question": "b", "solution": r"\boxed{\frac{1}{2}}"}])
    thousand, half = dry_run("--dataset", path)["problems"]
    assert thousand["gold_key"] == "1234"
    assert answers_equal(r"\boxed{1,234}"[7:-1], thousand["gold"])
    assert answers_equal("0.5", half["gold"])


def test_load_local_jsonl(small_jsonl):
    probs = dry_run("--dataset", small_jsonl)["problems"]
    assert [p["gold"] for p in probs] == ["3", "1234", "8"]
    assert probs[0]["question"] == "one plus two is" and probs[0]["kind"] == "math"
    assert [p["id"] for p in probs] == ["0", "1", "2"]
    assert len(dry_run("--dataset", small_jsonl, "--limit", "2")["problems"]) == 2


def test_load_other_fields_and_formats(tmp_path):
    rows = [{"id": "a", "problem": "Compute 1/2 + 0", "solution": r"It is $\boxed{\frac12}$."},
            {"id": "b", "problem": "2+2", "answer": 4}]
    probs = dry_run("--dataset", write_jsonl(tmp_path / "mixed.jsonl", rows))["problems"]
    assert [(p["id"], p["gold"]) for p in probs] == [("a", r"\frac12"), ("b", "4")]
    path = tmp_path / "list.json"
    path.write_text(json.dumps([{"question": "q", "answer": "#### 9"}]))
    assert dry_run("--dataset", path)["problems"][0]["gold"] == "9"


def test_load_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = str(tmp_path / "set.parquet")
    pq.write_table(pa.table({"problem": ["1+1", "2+3"], "answer": ["2", "5"]}), path)
    assert [p["gold"] for p in dry_run("--dataset", path)["problems"]] == ["2", "5"]


def test_bad_files(tmp_path):
    line = load_error(math_cli("--dataset", write_jsonl(tmp_path / "x.jsonl", [{"text": "hello"}]), "--dry-run"))
    assert "needs a question field" in line
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert str(empty) in load_error(math_cli("--dataset", empty, "--dry-run"))
    (tmp_path / "data.csv").write_text("a,b\n")
    assert "unsupported dataset file" in load_error(math_cli("--dataset", tmp_path / "data.csv", "--dry-run"))


def test_synthetic_set():
    from consensus_spec.model.synthetic import format_prompt, test_set
    got = dry_run("--dataset", "synthetic", "--limit", "5")
    ref = test_set(5)
    assert [p["gold"] for p in got["problems"]] == [str(r["answer"]) for r in ref]
    assert all(p["kind"] == "synthetic" for p in got["problems"])
    # the embedded model's training format, whatever the tokenizer
    assert [p["prompt"] for p in got["problems"]] == [format_prompt(r["question"]) for r in ref]
    assert got["prompt_style"] == "synthetic.format_prompt" and got["max_tokens"] == 256


# Rows in the layouts of ../shared/data/math/ (see its README), made up here: the named
# sets are read from that folder beside the repository, which a clone may lack, so the
# test runs the evals package from a folder of links whose ../shared/data/math has these.
SHARED_LAYOUTS = {
    "gsm8k": ("gsm8k_test.jsonl",
              [{"question": f"Ann has {i} pens and buys {i + 2} more. How many pens does she have?",
                "answer": f"She has {i} + {i + 2} = {2 * i + 2} pens.\n#### {2 * i + 2:,}"}
               for i in (1, 4, 7, 600, 9)]),
    "math500": ("math500_test.jsonl",
                [{"problem": f"Compute $\\frac{{{i}}}{{3}}$.", "solution": f"It is $\\boxed{{\\frac{{{i}}}{{3}}}}$.",
                  "answer": f"\\frac{{{i}}}{{3}}", "subject": "Algebra", "level": 1,
                  "unique_id": f"test/algebra/{i}.json"} for i in range(1, 6)]),
    "aime2024": ("aime2024_test.jsonl",
                 [{"id": 60 + i, "problem": f"Find the remainder when $7^{i}$ is divided by 1000.",
                   "solution": f"... so the answer is $\\boxed{{{7 ** i % 1000}}}$.",
                   "answer": str(7 ** i % 1000)} for i in range(1, 6)]),
}


@pytest.mark.parametrize("name", ["gsm8k", "math500", "aime2024"])
def test_shared_sets(name, tmp_path):
    root = tmp_path / "checkout"
    root.mkdir()
    for package in ("evals", "consensus_spec"):
        (root / package).symlink_to(os.path.join(REPO, package))
    (tmp_path / "shared" / "data" / "math").mkdir(parents=True)
    filename, rows = SHARED_LAYOUTS[name]
    write_jsonl(tmp_path / "shared" / "data" / "math" / filename, rows * 2)
    probs = dry_run("--dataset", name, "--limit", "5", cwd=root)["problems"]
    assert len(probs) == 5 and all(p["question"] and p["gold"] for p in probs)
    if name == "gsm8k":
        assert all(p["gold"].lstrip("-").replace(".", "").isdigit() for p in probs)
        assert "####" not in probs[0]["gold"] and probs[3]["gold"] == "1202"  # thousands comma dropped
    if name == "math500":
        assert probs[0]["gold"] == "\\frac{1}{3}" and probs[0]["id"] == "test/algebra/1.json"
    if name == "aime2024":
        assert [p["gold"] for p in probs] == ["7", "49", "343", "401", "807"] and probs[0]["id"] == "61"


# ---------------------------------------------------------------------------
# Prompts: built with the model directory's tokenizer, as the run builds them
# ---------------------------------------------------------------------------

MATH_INSTRUCTION = ("Solve the following math problem. Reason step by step, and put your final answer "
                    "within \\boxed{}.")


def tokenizer_dir(path, chat_template=None, adds_bos=True) -> str:
    """A model folder with a word-level tokenizer; BOS ``<s>`` (id 1) added to
    every text when ``adds_bos``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    path.mkdir()
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "x": 5}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "unk_token": "[UNK]"}
    if chat_template:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "config.json").write_text("{}")
    return str(path)


def test_prompts(tmp_path):
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": "What is 2+2?", "answer": "4"}])
    template = "<s>[USER]{{ messages[0]['content'] }}[/USER]"

    def prompt(model):
        got = dry_run("--dataset", data, model=model)
        assert got["tokenizer_error"] is None
        return got["prompt_style"], got["problems"][0]["prompt"]

    style, plain = prompt(tokenizer_dir(tmp_path / "plain"))
    assert style == "plain Question/Answer + boxed"
    assert plain.startswith(MATH_INSTRUCTION) and plain.endswith("Question: What is 2+2?\nAnswer:")
    assert "\\boxed{}" in plain
    style, chat = prompt(tokenizer_dir(tmp_path / "chat", chat_template=template))
    assert style == "chat template + boxed"
    assert chat.startswith("[USER]") and "What is 2+2?" in chat  # BOS not doubled
    assert chat == f"[USER]{MATH_INSTRUCTION}\n\nWhat is 2+2?[/USER]"
    _, chat_keep = prompt(tokenizer_dir(tmp_path / "keep", chat_template=template, adds_bos=False))
    assert chat_keep.startswith("<s>[USER]")
    # synthetic problems keep their own format with any tokenizer: test_synthetic_set
    synth = dry_run("--dataset", "synthetic", "--limit", "1", model=str(tmp_path / "chat"))["problems"][0]
    from consensus_spec.model.synthetic import format_prompt
    assert synth["prompt"] == format_prompt(synth["question"])


# rows in gsm8k_train.jsonl's layout, made up here (tests do not read ../shared)
TRAIN_ROWS = [
    {"question": "Tom has 3 boxes of 4 pens. How many pens?",
     "answer": "He has 3 * 4 = <<3*4=12>>12 pens.\n#### 12"},
    {"question": "  A farm sells 1,000 eggs a day and 200 more on Sunday. How many on Sunday?  ",
     "answer": "On Sunday it sells 1,000 + 200 = <<1000+200=1200>>1,200 eggs.\n#### 1,200"},
    {"question": "Never used.", "answer": "#### 0"},
]


def test_fewshot_prompts(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from evals.math import prompts, record
    from evals.math.datasets import MathProblem

    train = write_jsonl(tmp_path / "train.jsonl", TRAIN_ROWS)
    shots = prompts.fewshot_examples(2, train)  # the first K rows, in order
    assert shots == [
        ("Tom has 3 boxes of 4 pens. How many pens?", "He has 3 * 4 = 12 pens.\nThe answer is \\boxed{12}."),
        ("A farm sells 1,000 eggs a day and 200 more on Sunday. How many on Sunday?",
         "On Sunday it sells 1,000 + 200 = 1,200 eggs.\nThe answer is \\boxed{1200}.")]
    question = MathProblem("t-0", "What is 2+2?", "4")
    plain = prompts.build_prompt(question, None, shots)
    assert plain == (f"{MATH_INSTRUCTION}\n\n"
                     f"Question: {shots[0][0]}\nAnswer: {shots[0][1]}\n\n"
                     f"Question: {shots[1][0]}\nAnswer: {shots[1][1]}\n\n"
                     "Question: What is 2+2?\nAnswer:")
    assert prompts.build_prompt(question, None, ()) == prompts.build_prompt(question)  # zero-shot unchanged
    # a chat template: each example an earlier user turn (the zero-shot turn) and the assistant's answer
    template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}[/{{ m['role'] }}]{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(tmp_path / "chat", chat_template=template))
    turn = f"{MATH_INSTRUCTION}\n\n"
    assert prompts.build_prompt(question, tok, shots[:1]) == (
        f"[user]{turn}{shots[0][0]}[/user][assistant]{shots[0][1]}[/assistant]"
        f"[user]{turn}What is 2+2?[/user][assistant]")
    with pytest.raises(prompts.FewShotError, match="synthetic"):
        prompts.build_prompt(MathProblem("s", "1+1", "2", "synthetic"), None, shots)
    # clear errors: K out of range, a missing or malformed file
    with pytest.raises(prompts.FewShotError, match="must be >= 1"):
        prompts.fewshot_examples(0, train)
    with pytest.raises(prompts.FewShotError, match="has only 3 examples"):
        prompts.fewshot_examples(4, train)
    with pytest.raises(prompts.FewShotError, match="train split: .*absent.jsonl not found"):
        prompts.fewshot_examples(2, str(tmp_path / "absent.jsonl"))
    bad = write_jsonl(tmp_path / "bad.jsonl", [TRAIN_ROWS[0], {"question": "no answer"}])
    with pytest.raises(prompts.FewShotError, match="bad.jsonl, line 2: not a GSM8K row"):
        prompts.fewshot_examples(2, bad)
    # the record command: --fewshot checked before any engine starts
    for argv, message in ((["--fewshot", "0"], "--fewshot must be >= 1"),
                          (["--dataset", "synthetic", "--fewshot", "2"], "use it with --dataset gsm8k")):
        with pytest.raises(record.UsageError, match=message):
            record.parse_args(["--out", str(tmp_path / "r.jsonl"), *argv])
    assert record.parse_args(["--out", "r.jsonl", "--dataset", "gsm8k", "--fewshot", "2"]).fewshot == 2
    monkeypatch.setattr(prompts, "fewshot_file", lambda: train)
    assert record.load_shots(2) == shots and record.load_shots(None) == []
    monkeypatch.setattr(prompts, "fewshot_file", lambda: str(tmp_path / "absent.jsonl"))
    with pytest.raises(record.UsageError, match="needs GSM8K.s train split"):
        record.load_shots(2)


# ---------------------------------------------------------------------------
# Scoring and reporting
# ---------------------------------------------------------------------------


def from_json(tmp_path, rows, *args, name="r"):
    """``python -m evals math --from-json`` on ``rows`` written as a results
    file: (its stdout, the JSON it writes, its output prefix)."""
    src = tmp_path / f"{name}_in.json"
    src.write_text(json.dumps({"dataset": "made-up", "num_problems": len(rows[0]["per_problem"]),
                               "results": rows}))
    out = tmp_path / name
    stdout = ok(math_cli("--from-json", src, "--out", out, *args))
    return stdout, json.loads((tmp_path / f"{name}.json").read_text()), out


def row(method, n, per_problem, waves="all", early_stop="off", stop_rule=None, wave_sizes=None, **kw):
    """A result row as ``python -m evals math`` writes it."""
    return dict(dict(method=method, n=n, waves=waves, early_stop=early_stop, problems=len(per_problem),
                     pass_at_1=0.5, maj_at_n=0.5, mean_acceptance_length=None, drafted_tokens=0,
                     accepted_tokens=0, est_tokens_saved=0, stop_rule=rule(stop_rule),
                     wave_sizes=wave_sizes or [n], check="wave", tokens=100, wall_time_s=10.0,
                     tokens_per_s=10.0, per_problem=per_problem), **kw)


def problem(i, answer, answers=None, gold="1"):
    answers = answers if answers is not None else [answer]
    return dict(id=str(i), gold=gold, answer=answer, answers=answers,
                sample_tokens=[10] * len(answers))


def test_score_pass1_and_majority(tmp_path):
    per_problem = [problem(0, r"\frac{1}{2}", [r"\frac{1}{2}", "0.5", "2", None], gold="0.5"),
                   problem(1, "4", ["4", "4"], gold="3")]
    _, data, _ = from_json(tmp_path, [row("none", 4, per_problem)])
    (acc,) = data["results"]
    assert acc["pass_at_1"] == pytest.approx((2 / 4 + 0) / 2)  # re-graded from the recorded answers
    assert acc["maj_at_n"] == 0.5
    assert acc["per_problem"][0]["correct"] and not acc["per_problem"][1]["correct"]
    assert [p["samples_correct"] for p in acc["per_problem"]] == [2, 0]


def make_rows():
    plain_pp = [problem(0, "1", ["1", "1", "1", "2"]), problem(1, "2", ["2", "3", "2", "3"])]
    adaptive = row("consensus", 4, [problem(0, "1.0"), problem(1, "3")], waves="2,rest", early_stop="decided",
                   stop_rule=StopRule(kind="decided"), wave_sizes=[2, 2], tokens=60, wall_time_s=3.0,
                   tokens_per_s=20.0)
    return [row("none", 4, plain_pp),
            row("consensus", 4, [problem(0, "1"), problem(1, "3")], tokens=120, wall_time_s=6.0,
                tokens_per_s=20.0, mean_acceptance_length=2.5, drafted_tokens=80, accepted_tokens=30),
            adaptive,
            row("consensus", 8, plain_pp, tokens=200, wall_time_s=8.0, tokens_per_s=25.0)]


def tradeoff_table(stdout) -> list[str]:
    """The trade-off table lines in the command's stdout."""
    lines = stdout.split("stop rules replayed on the plain runs' samples:\n")[1].splitlines()
    return lines[:next(i for i, line in enumerate(lines) if not line.startswith("|"))]


def test_comparisons_table_and_plots(tmp_path):
    stdout, data, out = from_json(tmp_path, make_rows(), "--tradeoff-rules", "decided", "predictive:0.2")
    none, cons, adaptive, cons8 = data["results"]
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
    table = stdout.split("\nstop rules replayed")[0]
    # the noise floor: plain none and plain consensus at n=4 agree on 1 of 2 answers, nothing else pairs
    floor = [line for line in table.splitlines() if line.startswith("Full-n answer agreement")]
    assert len(floor) == 1 and floor[0].endswith("): none vs consensus (n=4) 0.500")
    assert table.count("\n| ") == 4 and "| consensus | 4 | 2,rest | decided |" in table
    assert table in (tmp_path / "r.md").read_text()
    points = data["tradeoff_replay"]
    assert {(p["method"], p["n"], p["waves"], p["rule"]) for p in points} == {
        (m, n, "2,rest+wave-check", r) for m, n in (("none", 4), ("consensus", 4), ("consensus", 8))
        for r in ("decided", "predictive(error=0.2, min=3)")}
    md = tradeoff_table(stdout)
    assert len(md) == len(points) + 2
    assert "\n".join(md) in (tmp_path / "r.md").read_text()
    for png in ("r.png", "r_tradeoff.png"):
        assert (tmp_path / png).stat().st_size > 1000
    assert f"wrote {out}.json, {out}.md, {out}.png, {out}_tradeoff.png" in stdout


def test_repeats_compare_within_each_repeat_and_report_the_spread(tmp_path):
    pp = [problem(0, "1"), problem(1, "2")]
    walls = {(0, "none"): 10.0, (0, "consensus"): 8.0, (1, "none"): 12.0, (1, "consensus"): 5.0,
             (2, "none"): 9.0, (2, "consensus"): 10.0}
    rows = [row(m, 4, pp, repeat=k, wall_time_s=w, cpu_time_s=2 * w, tokens_per_s=100 / w)
            for (k, m), w in walls.items()]
    stdout, data, _ = from_json(tmp_path, rows)
    speedups = {(r["repeat"], r["method"]): r["wall_speedup"] for r in data["results"]}
    # each repeat against its own plain none, never another repeat's
    assert speedups[0, "consensus"] == pytest.approx(10 / 8)
    assert speedups[1, "consensus"] == pytest.approx(12 / 5)
    assert speedups[2, "consensus"] == pytest.approx(9 / 10)
    assert all(speedups[k, "none"] == 1.0 for k in range(3))
    (entry,) = report.spread(data["results"])
    assert entry["method"] == "consensus" and entry["repeats"] == 3
    assert entry["wall"] == pytest.approx(sorted([10 / 8, 12 / 5, 9 / 10]))
    assert entry["wall_summed"] == pytest.approx(31 / 23) and entry["cpu_summed"] == pytest.approx(31 / 23)
    assert "| consensus | 4 | all | off | 3 | 1.25 (0.90–2.40), summed 1.35 | 1.25 (0.90–2.40), " \
           "summed 1.35 |" in stdout
    assert stdout.count("| 1 | consensus | 4 |") == 1  # the table says which repeat each row is


def test_repeats_alternate_the_methods_order(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from evals.math import runs

    ran = []

    def fake_isolated(fn, method, configs, *rest):
        ran.append(method)
        return [{"method": method, "n": n} for n, _, _ in configs]

    monkeypatch.setattr(runs, "isolated", fake_isolated)
    args = SimpleNamespace(methods=["none", "consensus"], configs=[(16, None, None)], reuse_engine=False,
                           repeats=3, out=str(tmp_path / "m"))
    rows = runs.run_all(args, [], 8)
    assert ran == ["none", "consensus", "consensus", "none", "none", "consensus"]
    assert [r["repeat"] for r in rows] == [0, 0, 1, 1, 2, 2]


def test_replay_measures_stopping_error_on_plain_samples(tmp_path):
    # problem 0: unanimous -> predictive stops after the first wave of 4 (4/16 of the tokens);
    # problem 1: 10-6 for "2", but the first wave of 4 is unanimous for "1"
    unanimous = ["5"] * 16
    misleading = ["1"] * 6 + ["2"] * 2 + ["2"] * 8
    plain = row("none", 16, [problem(0, "5", unanimous, gold="5"), problem(1, "2", misleading, gold="2")])
    waves = dict(waves="4,4,rest", wave_sizes=[4, 4, 8])
    rows = [plain,
            row("none", 16, plain["per_problem"], early_stop="decided", stop_rule=StopRule(kind="decided"), **waves),
            row("none", 16, plain["per_problem"], early_stop="on", stop_rule=StopRule(), **waves),
            row("none", 16, plain["per_problem"], waves="all+path-check", early_stop="on", stop_rule=StopRule(),
                check="path")]
    _, data, _ = from_json(tmp_path, rows, "--tradeoff-rules", "decided", "on")
    plain, exact, rep, per_path = data["results"]
    assert plain["maj_at_n"] == 1.0
    points = {(p["waves"], p["rule"]): p for p in data["tradeoff_replay"]}
    assert exact["replay_agreement"] == 1.0
    wave = "4,4,rest+wave-check"  # the rows' own check, whole waves
    assert points[(wave, "decided")]["agreement"] == 1.0 and points[(wave, "decided")]["maj"] == 1.0
    assert rep["replay_tokens"] == pytest.approx((4 + 4) / 32)
    assert rep["replay_agreement"] == 0.5  # problem 1 stopped on the wrong leader
    on = points[(wave, StopRule().describe())]
    assert on["tokens_frac"] == pytest.approx((4 + 4) / 32) and on["agreement"] == 0.5 and on["maj"] == 0.5
    assert per_path["replay_tokens"] <= rep["replay_tokens"]


def test_from_json_errors(tmp_path):
    assert "file not found" in usage_error(math_cli("--from-json", tmp_path / "none.json"))
    (tmp_path / "bad.json").write_text("{}")
    assert "not a results file" in usage_error(math_cli("--from-json", tmp_path / "bad.json"))
    (tmp_path / "old.json").write_text(json.dumps({"results": [dict(row("none", 4, []), early_stop="decided",
                                                                    stop_rule=None)]}))
    assert "has no stop_rule" in usage_error(math_cli("--from-json", tmp_path / "old.json"))
    assert "--tradeoff-rules takes stop rules" in usage_error(math_cli("--tradeoff-rules", "off"))


# ---------------------------------------------------------------------------
# End to end on a tiny random Llama (slow: two vLLM engines)
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.vllm
def test_cli_end_to_end_on_tiny_llama(tmp_path, small_jsonl):
    from tests.tiny_model import build_tiny_llama

    # engines run in the command's own process on CPU, as it runs them by default there
    # (two in a row, after numba is loaded: vllm_compat makes that work); the KV budget
    # then counts that process's own memory too, hence the larger utilization
    model = build_tiny_llama(str(tmp_path / "tiny"))
    out = tmp_path / "res" / "math"
    stdout = ok(math_cli("--dataset", small_jsonl, "--model", model, "--n", "2", "--limit", "2",
                         "--methods", "none", "consensus", "--max-tokens", "16",
                         "--dtype", "float32", "--gpu-memory-utilization", "0.2",
                         "--max-model-len", "256", "--out", out, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}))
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
    assert "| none |" in stdout
    assert not (tmp_path / "res" / "math.partial.json").exists()
    assert all(r["stop_rule"] is None for r in rows.values())  # plain runs: what --from-json rebuilds


def test_waves_simulation_on_plain_samples(tmp_path):
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
    out = ok(run_evals("waves-sim", path, "--waves", "4,4,rest", "all+wave-check", "--rules", "on", "decided",
                       "--capacity", "32", "--perms", "2"))
    rows = [line for line in out.splitlines() if line.startswith("| 4,4,rest") or line.startswith("| all")]
    assert len(rows) == 4
    # all at once voting after whole waves never stops: exactly the baseline;
    # waves + the default rule save tokens
    assert rows[2].split("|")[3].strip() == "100.0"
    assert float(rows[0].split("|")[3]) < 100.0


def test_serve_sc_replays_the_endpoints_stop_rule_on_full_n_paths():
    """serve-sc's agreement: the default rule and waves of 2 replayed on one
    full-n answer's paths in wave order, against those paths' full-n vote."""
    from evals.math.serve_sc import replayed_stop

    settled = {"path_answers": ["7"] * 16, "path_tokens": [10] * 16}
    out = replayed_stop(settled, 16)
    assert out["agree"] and out["paths"] < 16 and out["tokens"] == 10 * out["paths"]
    # an early lead that the later paths overturn: a rule that stops on it disagrees
    flip = {"path_answers": ["3"] * 4 + ["8"] * 12, "path_tokens": list(range(1, 17))}
    assert replayed_stop(flip, 16) == {"agree": False, "paths": 4, "tokens": 1 + 2 + 3 + 4}


def test_auto_dtype_is_float32_on_a_cpu_without_native_bf16(monkeypatch):
    """Without AVX-512 BF16 or AMX, bf16 matmuls fall back to slow kernels:
    ``--dtype auto`` runs float32 there; an explicit dtype is kept."""
    import torch.cpu

    from evals.math import llm

    monkeypatch.setattr(llm, "on_cpu", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert llm.engine_dtype("auto") == "float32"
    assert llm.engine_dtype("bfloat16") == "bfloat16"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert llm.engine_dtype("auto") == "auto"


def _cmdline(pid: int) -> bytes:
    """``pid``'s command line (empty once it has gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_an_isolated_engine_process_ends_when_its_parent_is_killed():
    """evals runs each engine in a spawned process (runs.isolated); a parent
    killed by a signal runs no cleanup, and its worker, left behind, kept
    1.3 GB and CPU time on a 2-core machine for as long as nobody looked."""
    import signal
    import subprocess
    import sys
    import time

    from evals.math.servers import process_tree

    parent = subprocess.Popen([sys.executable, "-c", "import time; from evals.math.runs import "
                               "isolated; isolated(time.sleep, 300)"], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        workers = []
        while not workers and time.monotonic() < deadline:
            time.sleep(0.2)
            workers = [p for p in process_tree(parent.pid)[1:] if b"spawn_main" in _cmdline(p)]
        assert workers, "the worker never started"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{w}") for w in workers):
            time.sleep(0.2)
        alive = [w for w in workers if os.path.exists(f"/proc/{w}")]
        for w in alive:
            os.kill(w, signal.SIGKILL)
        assert not alive, "the worker outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_benchmark_server_is_stopped_when_its_parent_is_killed(tmp_path):
    """evals' servers (servers.VllmServer) lead their own process group, so
    a parent killed by a signal left them serving; now the server gets
    SIGTERM (vLLM's API server then shuts its engine core down). A stand-in
    server records the signal it got."""
    import signal
    import subprocess
    import sys
    import time

    got = tmp_path / "got"
    stand_in = ("import signal, sys, time\n"
                "def term(*_):\n"
                f"    open({str(got)!r}, 'w').write('SIGTERM'); sys.exit(0)\n"
                "signal.signal(signal.SIGTERM, term)\n"
                "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom evals.math.servers import VllmServer\n"
        f"s = VllmServer([], {str(tmp_path / 'log')!r})\n"
        f"s.cmd = [sys.executable, '-c', {stand_in!r}]\n"
        "s.start(); print(s.proc.pid, flush=True); time.sleep(120)\n")],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    server = None
    try:
        server = int(parent.stdout.readline())
        time.sleep(1.0)  # the stand-in's handler is set
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not got.exists():
            time.sleep(0.2)
        assert got.exists() and got.read_text() == "SIGTERM", "the server was not told to stop"
        while time.monotonic() < deadline and _cmdline(server):
            time.sleep(0.2)
        assert not _cmdline(server), "the server outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        if server is not None and _cmdline(server):
            os.kill(server, signal.SIGKILL)
