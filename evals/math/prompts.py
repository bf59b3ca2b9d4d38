"""Prompt templates for ``python -m evals math``.

GSM8K / MATH / AIME (and local files): ask for step-by-step reasoning with the
final answer in ``\\boxed{}``; rendered with the tokenizer's chat template when
it has one, else as plain ``Question: ...\\nAnswer:`` text.  The synthetic set
uses :func:`consensus_spec.model.synthetic.format_prompt`, the embedded model's
training format.

Few-shot (``record --fewshot K``): the first K solved problems of GSM8K's
train split (``../shared/data/math/gsm8k_train.jsonl``), each answer's
``<<calc>>`` notes dropped and its ``#### N`` line written as the boxed
answer the instruction asks for, go before the question: as earlier
user/assistant turns with a chat template, else as ``Question:/Answer:``
pairs.
"""

from __future__ import annotations

import json
import os
import re

from consensus_spec.model.synthetic import format_prompt

from .datasets import SHARED_MATH, gold_answer

MATH_INSTRUCTION = (
    "Solve the following math problem. Reason step by step, and put your final answer "
    "within \\boxed{}."
)


class FewShotError(ValueError):
    """Few-shot examples that cannot be built (message is one line, for the CLI)."""


def fewshot_file() -> str:
    return os.path.join(SHARED_MATH, "gsm8k_train.jsonl")


def worked_answer(answer: str) -> str:
    """A GSM8K ``answer`` in the prompts' answer format: the reasoning
    without its ``<<calc>>`` notes, then ``The answer is \\boxed{N}.``"""
    if "####" not in answer:
        raise FewShotError(f"not a GSM8K answer (no '#### N' line): {answer[:60]!r}")
    steps = re.sub(r"<<[^>]*>>", "", answer.rsplit("####", 1)[0]).strip()
    final = "The answer is \\boxed{" + gold_answer(answer) + "}."
    return f"{steps}\n{final}" if steps else final


def fewshot_examples(k: int, path: str | None = None) -> list[tuple[str, str]]:
    """(question, worked answer) of the first ``k`` rows of ``path``
    (default: GSM8K's train split in ../shared); FewShotError if the file
    is absent, short or not GSM8K-shaped."""
    path = path or fewshot_file()
    if k < 1:
        raise FewShotError(f"--fewshot must be >= 1, got {k}")
    if not os.path.isfile(path):
        raise FewShotError(f"--fewshot needs GSM8K's train split: {path} not found")
    shots = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if len(shots) == k:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                shots.append((str(row["question"]).strip(), worked_answer(str(row["answer"]))))
            except (ValueError, KeyError, TypeError) as e:
                raise FewShotError(f"{path}, line {lineno}: not a GSM8K row with question and "
                                   f"answer ({type(e).__name__}: {e})") from None
    if len(shots) < k:
        raise FewShotError(f"--fewshot {k}: {path} has only {len(shots)} examples")
    return shots


def user_turn(question: str) -> str:
    return f"{MATH_INSTRUCTION}\n\n{question.strip()}"


def chat_prompt(question: str, tokenizer, shots=()) -> str:
    """The chat-rendered prompt text, ``shots`` ((question, answer) pairs)
    as earlier turns.  A leading BOS that the template writes is dropped
    when the tokenizer adds one itself, so it is not doubled."""
    messages = []
    for q, a in shots:
        messages += [{"role": "user", "content": user_turn(q)}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": user_turn(question)})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos) and _adds_bos(tokenizer):
        text = text[len(bos):]
    return text


def _adds_bos(tokenizer) -> bool:
    try:
        ids = tokenizer("x").input_ids  # what vLLM does to a text prompt
    except Exception:  # noqa: BLE001 - odd tokenizer: keep the template as written
        return False
    bos_id = getattr(tokenizer, "bos_token_id", None)
    return bos_id is not None and bool(ids) and ids[0] == bos_id


def build_prompt(problem, tokenizer=None, shots=()) -> str:
    """Prompt text for one :class:`evals.math.datasets.MathProblem`, after
    the solved examples ``shots`` (:func:`fewshot_examples`) if any."""
    if problem.kind == "synthetic":
        if shots:
            raise FewShotError("few-shot examples do not apply to the synthetic set (its own format)")
        return format_prompt(problem.question)
    if getattr(tokenizer, "chat_template", None):
        return chat_prompt(problem.question, tokenizer, shots)
    # str concatenation, not format(): questions are full of LaTeX braces
    solved = "".join("Question: " + q + "\nAnswer: " + a + "\n\n" for q, a in shots)
    return MATH_INSTRUCTION + "\n\n" + solved + "Question: " + problem.question.strip() + "\nAnswer:"


def prompt_style(problems, tokenizer=None) -> str:
    """Short description of the template used (for the report)."""
    if problems and all(p.kind == "synthetic" for p in problems):
        return "synthetic.format_prompt"
    chat = getattr(tokenizer, "chat_template", None)
    return "chat template + boxed" if chat else "plain Question/Answer + boxed"
