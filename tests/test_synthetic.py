"""Synthetic corpus, embedded tokenizer and the shipped embedded model."""

from __future__ import annotations

import ast
import operator
import re
from pathlib import Path

import pytest

from consensus_spec.model import synthetic
from consensus_spec.model.synthetic import (
    extract_answer,
    format_example,
    format_prompt,
    generate_problems,
    test_set,
)

MODEL_DIR = Path(synthetic.__file__).resolve().parent  # the model package, beside synthetic.py
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate(expr: str) -> int:
    """Evaluate a +,-,*,/ integer expression; division must be exact."""

    def ev(node):
        if isinstance(node, ast.Constant):
            return node.value
        left, right = ev(node.left), ev(node.right)
        if isinstance(node.op, ast.Div):
            assert right != 0 and left % right == 0, f"inexact division in {expr}"
            return left // right
        return _OPS[type(node.op)](left, right)

    return ev(ast.parse(expr, mode="eval").body)


_EQ = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def test_generator_is_deterministic():
    assert generate_problems(200, seed=7) == generate_problems(200, seed=7)
    assert generate_problems(50, seed=7) == generate_problems(200, seed=7)[:50]
    assert generate_problems(50, seed=7) != generate_problems(50, seed=8)
    assert test_set(100) == test_set(100)


def test_answers_match_structure_and_cot():
    probs = generate_problems(1000, seed=0)
    for p in probs:
        assert set(p) >= {"question", "solution", "answer"}
        assert isinstance(p["answer"], int) and p["answer"] >= 0
        assert 2 <= p["steps"] <= 4
        assert _evaluate(p["program"]) == p["answer"]
        lines = p["solution"].split("\n")
        assert lines[-1] == f"The answer is {p['answer']}."
        assert extract_answer(p["solution"]) == p["answer"]
        eqs = _EQ.findall(p["solution"])
        assert len(eqs) == p["steps"]  # one equation per step
        for a, op, b, c in eqs:
            assert _evaluate(f"{a} {op} {b}") == int(c)
        assert int(eqs[-1][3]) == p["answer"]
        assert p["question"].endswith("?")
    assert {p["steps"] for p in probs} == {2, 3, 4}
    ops = "".join(op for p in probs for _, op, _, _ in _EQ.findall(p["solution"]))
    assert set(ops) == set("+-*/")


def _skeleton(line: str) -> str:
    line = re.sub(r"\d+", "N", line)
    for name in synthetic.NAMES:
        line = re.sub(rf"\b{name}\b", "P", line)
    for item in synthetic.ITEMS:
        line = line.replace(item, "I")
    return line


def test_phrasing_and_step_order_vary():
    probs = generate_problems(500, seed=1)
    step_lines = {_skeleton(l) for p in probs for l in p["solution"].split("\n")[1:-1]}
    assert len(step_lines) >= 15
    starts = {_skeleton(p["solution"].split("\n")[0]) for p in probs}
    assert len(starts) >= 3
    # Question sentences vary too.
    assert len({_skeleton(p["question"].split(". ")[1]) for p in probs}) >= 10
    # Two-person problems compute either person first.
    first_is_asked_first = set()
    for p in probs:
        if "together" in p["question"] or "in total" in p["question"]:
            q_first = p["question"].split()[0]
            s_first = p["solution"].split("\n")[0]
            first_is_asked_first.add(q_first in s_first)
    assert first_is_asked_first == {True, False}


def test_test_set_disjoint_from_training():
    held_out = {p["question"] for p in test_set(500)}
    assert len(held_out) >= 490
    for seed in range(3):
        train = {p["question"] for p in generate_problems(5000, seed=seed)}
        assert not held_out & train


def test_prompt_format_and_extraction():
    p = test_set(1)[0]
    prompt, completion = format_example(p)
    assert prompt == format_prompt(p["question"]) == f"Question: {p['question']}\nAnswer:"
    assert completion.startswith(" ") and completion.strip() == p["solution"]
    assert extract_answer("x The answer is 3. then The answer is 17.") == 17
    assert extract_answer("no final line") is None


def test_built_tokenizer_round_trips_and_splits_digits():
    from consensus_spec.model import BOS, build_tokenizer

    texts = [" ".join(format_example(p)) for p in generate_problems(500, seed=0)]
    tok = build_tokenizer(texts, vocab_size=400)
    for p in test_set(20):
        text = " ".join(format_example(p))
        enc = tok.encode(text)
        assert enc.tokens[0] == BOS
        assert tok.decode(enc.ids) == text  # BOS is skipped as a special token
    toks = tok.encode("The answer is 1234.", add_special_tokens=False).tokens
    assert [t for t in toks if any(c.isdigit() for c in t)] == ["1", "2", "3", "4"]


needs_model = pytest.mark.skipif(
    not (MODEL_DIR / "config.json").exists(), reason="embedded model not trained"
)


@needs_model
def test_shipped_model_size_and_architecture():
    import json

    size = sum(f.stat().st_size for f in MODEL_DIR.iterdir() if f.is_file())
    assert size <= 20 * 1024 * 1024
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64
    assert cfg.get("head_dim", 64) == 64
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (MODEL_DIR / name).exists(), name


@needs_model
def test_shipped_model_loads_and_answers_in_format():
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    assert model.config.head_dim == 64
    p = test_set(1)[0]
    text = " ".join(format_example(p))
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    enc = tok(format_prompt(p["question"]), return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=200,
                             pad_token_id=tok.pad_token_id)
    completion = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert out[0, -1].item() == tok.eos_token_id  # stops by itself
    assert extract_answer(completion) is not None
