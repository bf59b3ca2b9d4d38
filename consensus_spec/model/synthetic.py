"""Seeded synthetic corpus of multi-step arithmetic word problems.

Used to train the project's embedded default model (``consensus_spec/model``).
Every problem has 2-4 arithmetic steps over small integers: start values
2-25, add or subtract 1-9, multiply or divide (exactly) by 2-5, intermediate
values in 1-120; two-person problems combine two chains with + or -.
Solutions are chain-of-thought text, one step per line, and always end with the
fixed final line::

    The answer is 42.

Phrasing is drawn from several templates per step, and in two-person problems
the solution may compute either person first, so sampled paths differ in
wording while often agreeing on the answer.

Prompt format (plain text, no chat roles)::

    Question: <question>
    Answer:

and the model continues with ``" " + solution`` followed by EOS.

Train/test split is by a hash of the question text, so ``test_set`` problems
can never appear in any ``generate_problems`` output, whatever the seeds.
"""

from __future__ import annotations

import hashlib
import random
import re

__all__ = [
    "generate_problems",
    "test_set",
    "format_prompt",
    "format_example",
    "extract_answer",
    "ANSWER_PREFIX",
]

ANSWER_PREFIX = "The answer is"
_ANSWER_RE = re.compile(r"The answer is (-?\d+)\.")
_TEST_BUCKETS = 10  # 1 in 10 question hashes belong to the test split

NAMES = [
    "Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Sara", "Tom",
    "Ines", "Kofi", "Yuki", "Ben", "Nora", "Ali", "Emma", "Leo", "Ivy", "Max",
]
ITEMS = [
    "apples", "marbles", "stickers", "cookies", "books", "pencils", "coins",
    "cards", "shells", "stamps", "balloons", "beads", "eggs", "toys", "candies",
]

# Question sentences per operation: {p}=person, {k}=operand, {it}=items, {f}=friend.
_Q = {
    "+": [
        "{p} buys {k} more {it}.",
        "Then {p} finds {k} {it}.",
        "{f} gives {p} {k} more {it}.",
        "Later {p} gets {k} extra {it}.",
    ],
    "-": [
        "{p} gives {k} {it} to {f}.",
        "Then {p} loses {k} {it}.",
        "{p} uses up {k} of the {it}.",
        "Later {p} sells {k} {it}.",
    ],
    "*": [
        "Then the number of {it} {p} has becomes {k} times as large.",
        "{p} ends up with {k} times as many {it} as before.",
        "{p} multiplies the collection of {it} by {k}.",
    ],
    "/": [
        "{p} splits the {it} into {k} equal groups and keeps one group.",
        "{p} shares the {it} equally among {k} friends, keeping one share.",
        "Then {p} keeps only one of {k} equal parts of the {it}.",
    ],
}
# Solution sentences per operation: {a} before, {k} operand, {r} result.
_S = {
    "+": [
        "After getting {k} more, {p} has {a} + {k} = {r} {it}.",
        "{a} + {k} = {r}, so {p} now has {r} {it}.",
        "Adding {k} gives {a} + {k} = {r} {it}.",
    ],
    "-": [
        "After losing {k}, {p} has {a} - {k} = {r} {it}.",
        "{a} - {k} = {r}, so {p} now has {r} {it}.",
        "Taking away {k} leaves {a} - {k} = {r} {it}.",
    ],
    "*": [
        "Multiplying by {k}, {p} has {a} * {k} = {r} {it}.",
        "{a} * {k} = {r}, so {p} now has {r} {it}.",
        "{k} times as many is {a} * {k} = {r} {it}.",
    ],
    "/": [
        "Splitting into {k} parts, {p} keeps {a} / {k} = {r} {it}.",
        "{a} / {k} = {r}, so {p} now has {r} {it}.",
        "One of {k} equal parts is {a} / {k} = {r} {it}.",
    ],
}
_START_S = [
    "{p} starts with {a} {it}.",
    "At first {p} has {a} {it}.",
    "{p} begins with {a} {it}.",
]
_START_Q = ["{p} has {a} {it}.", "{p} starts with {a} {it}.", "{p} owns {a} {it}."]
_ASK_ONE = [
    "How many {it} does {p} have now?",
    "How many {it} does {p} have in the end?",
    "How many {it} does {p} end up with?",
]
_ASK_SUM = [
    "How many {it} do {p} and {q} have together?",
    "How many {it} do {p} and {q} have in total?",
]
_ASK_DIFF = [
    "How many more {it} does {p} have than {q}?",
    "How many fewer {it} does {q} have than {p}?",
]
_SUM_S = [
    "Together they have {x} + {y} = {r} {it}.",
    "In total that is {x} + {y} = {r} {it}.",
]
_DIFF_S = [
    "The difference is {x} - {y} = {r} {it}.",
    "So {p} has {x} - {y} = {r} more {it}.",
]

MAX_VALUE = 120  # intermediate results stay in [1, MAX_VALUE]


def _pick_op(rng: random.Random, a: int) -> tuple[str, int, int]:
    """Choose an operation valid for current value ``a``; return (op, k, result)."""
    while True:
        op = rng.choice("++--*/")
        if op == "+":
            k = rng.randint(2, 9)
            r = a + k
        elif op == "-":
            if a < 3:
                continue
            k = rng.randint(1, min(a - 1, 9))
            r = a - k
        elif op == "*":
            k = rng.randint(2, 5)
            r = a * k
        else:
            divisors = [d for d in range(2, 6) if a % d == 0 and a // d >= 1]
            if not divisors:
                continue
            k = rng.choice(divisors)
            r = a // k
        if 1 <= r <= MAX_VALUE:
            return op, k, r


def _chain(rng: random.Random, n_ops: int) -> tuple[int, list[tuple[str, int, int, int]]]:
    """A start value and ``n_ops`` steps as (op, a, k, result)."""
    start = rng.randint(2, 25)
    a, steps = start, []
    for _ in range(n_ops):
        op, k, r = _pick_op(rng, a)
        steps.append((op, a, k, r))
        a = r
    return start, steps


def _program(start: int, steps) -> str:
    expr = str(start)
    for op, _a, k, _r in steps:
        expr = f"({expr} {op} {k})"
    return expr


def _solve_person(rng, p, it, start, steps) -> list[str]:
    lines = [rng.choice(_START_S).format(p=p, a=start, it=it)]
    for op, a, k, r in steps:
        lines.append(rng.choice(_S[op]).format(p=p, a=a, k=k, r=r, it=it))
    return lines


def _ask_person(rng, p, f, it, start, steps) -> list[str]:
    sents = [rng.choice(_START_Q).format(p=p, a=start, it=it)]
    for op, _a, k, _r in steps:
        sents.append(rng.choice(_Q[op]).format(p=p, k=k, it=it, f=f))
    return sents


def _one_person(rng: random.Random, n_steps: int) -> dict:
    p, f = rng.sample(NAMES, 2)
    it = rng.choice(ITEMS)
    start, steps = _chain(rng, n_steps)
    q = _ask_person(rng, p, f, it, start, steps)
    q.append(rng.choice(_ASK_ONE).format(p=p, it=it))
    answer = steps[-1][3]
    sol = _solve_person(rng, p, it, start, steps)
    return _finish(" ".join(q), sol, answer, _program(start, steps), n_steps)


def _two_people(rng: random.Random, n_steps: int) -> dict:
    """Two independent chains combined by + or - (the combine is one step)."""
    p, q_, f = rng.sample(NAMES, 3)
    it = rng.choice(ITEMS)
    n_p = rng.randint(1, n_steps - 1) if n_steps > 2 else 1
    n_q = n_steps - 1 - n_p
    sp, steps_p = _chain(rng, n_p)
    sq, steps_q = _chain(rng, n_q)
    vp = steps_p[-1][3] if steps_p else sp
    vq = steps_q[-1][3] if steps_q else sq
    prog_p, prog_q = _program(sp, steps_p), _program(sq, steps_q)
    diff = rng.random() < 0.5 and vp != vq
    if diff and vp < vq:  # ask about whoever ends with more
        p, q_, sp, sq, steps_p, steps_q = q_, p, sq, sp, steps_q, steps_p
        vp, vq, prog_p, prog_q = vq, vp, prog_q, prog_p
    question = _ask_person(rng, p, f, it, sp, steps_p)
    question += _ask_person(rng, q_, f, it, sq, steps_q)
    sol_p = _solve_person(rng, p, it, sp, steps_p)
    sol_q = _solve_person(rng, q_, it, sq, steps_q)
    sol = sol_p + sol_q if rng.random() < 0.5 else sol_q + sol_p  # step order varies
    if diff:
        question.append(rng.choice(_ASK_DIFF).format(p=p, q=q_, it=it))
        answer = vp - vq
        sol.append(rng.choice(_DIFF_S).format(p=p, x=vp, y=vq, r=answer, it=it))
        prog = f"({prog_p} - {prog_q})"
    else:
        question.append(rng.choice(_ASK_SUM).format(p=p, q=q_, it=it))
        answer = vp + vq
        sol.append(rng.choice(_SUM_S).format(x=vp, y=vq, r=answer, it=it))
        prog = f"({prog_p} + {prog_q})"
    return _finish(" ".join(question), sol, answer, prog, n_steps)


def _finish(question, sol_lines, answer, program, n_steps) -> dict:
    solution = "\n".join(sol_lines + [f"{ANSWER_PREFIX} {answer}."])
    return {
        "question": question,
        "solution": solution,
        "answer": int(answer),
        "program": program,  # arithmetic expression whose value is ``answer``
        "steps": n_steps,
    }


def _is_test(question: str) -> bool:
    h = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(h[:4], "big") % _TEST_BUCKETS == 0


def _generate(n: int, rng: random.Random, want_test: bool, min_steps: int, max_steps: int):
    out = []
    while len(out) < n:
        n_steps = rng.randint(min_steps, max_steps)
        make = _two_people if rng.random() < 0.4 else _one_person
        prob = make(rng, n_steps)
        if _is_test(prob["question"]) == want_test:
            out.append(prob)
    return out


def generate_problems(n: int, seed: int = 0, min_steps: int = 2, max_steps: int = 4) -> list[dict]:
    """``n`` training problems, deterministic in ``seed``.

    Each dict has ``question``, ``solution`` (CoT ending in "The answer is N."),
    ``answer`` (int), ``program`` (the arithmetic expression) and ``steps``.
    """
    return _generate(n, random.Random(f"train:{seed}"), False, min_steps, max_steps)


def test_set(n: int = 500, seed: int = 1234, min_steps: int = 2, max_steps: int = 4) -> list[dict]:
    """Held-out problems; disjoint from every ``generate_problems`` output."""
    return _generate(n, random.Random(f"test:{seed}"), True, min_steps, max_steps)


test_set.__test__ = False  # keep pytest from collecting it as a test


def format_prompt(question: str) -> str:
    """The plain-text prompt the embedded model was trained on."""
    return f"Question: {question}\nAnswer:"


def format_example(problem: dict) -> tuple[str, str]:
    """(prompt, completion) for training; the tokenizer adds BOS, trainer adds EOS."""
    return format_prompt(problem["question"]), " " + problem["solution"]


def extract_answer(text: str) -> int | None:
    """The integer after the last "The answer is", or None."""
    found = _ANSWER_RE.findall(text)
    return int(found[-1]) if found else None
