"""Prompt templates for ``python -m evals math``.

GSM8K / MATH / AIME (and local files): ask for step-by-step reasoning with the
final answer in ``\\boxed{}``; rendered with the tokenizer's chat template when
it has one, else as plain ``Question: ...\\nAnswer:`` text.  The synthetic set
uses :func:`consensus_spec.model.synthetic.format_prompt`, the embedded model's
training format.
"""

from __future__ import annotations

from consensus_spec.model.synthetic import format_prompt

MATH_INSTRUCTION = (
    "Solve the following math problem. Reason step by step, and put your final answer "
    "within \\boxed{}."
)


def chat_prompt(question: str, tokenizer) -> str:
    """The chat-rendered prompt text.  A leading BOS that the template writes
    is dropped when the tokenizer adds one itself, so it is not doubled."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{MATH_INSTRUCTION}\n\n{question.strip()}"}],
        tokenize=False, add_generation_prompt=True)
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


def build_prompt(problem, tokenizer=None) -> str:
    """Prompt text for one :class:`evals.math.datasets.MathProblem`."""
    if problem.kind == "synthetic":
        return format_prompt(problem.question)
    if getattr(tokenizer, "chat_template", None):
        return chat_prompt(problem.question, tokenizer)
    # str concatenation, not format(): questions are full of LaTeX braces
    return MATH_INSTRUCTION + "\n\nQuestion: " + problem.question.strip() + "\nAnswer:"


def prompt_style(problems, tokenizer=None) -> str:
    """Short description of the template used (for the report)."""
    if problems and all(p.kind == "synthetic" for p in problems):
        return "synthetic.format_prompt"
    chat = getattr(tokenizer, "chat_template", None)
    return "chat template + boxed" if chat else "plain Question/Answer + boxed"
