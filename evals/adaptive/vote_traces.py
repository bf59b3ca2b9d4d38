"""Recorded traces as votes: each completion's answer clustered into a class
id, with its token count, for replaying stop rules (``stop-rules``,
``waves``) and scoring against the gold answer.  Program-of-thought answers
(``*_pot_*`` sets) are folded statically from the program text, never run."""

from __future__ import annotations

import ast
import operator
import os
from dataclasses import dataclass
from fractions import Fraction

from consensus_spec.sampling.stopping import should_stop_ids, tally
from consensus_spec.voting.answers import answers_equal, extract_answer
from consensus_spec.voting.vote import cluster_answers

from ..traces import TraceLines, completion_texts, trace_id

MAX_PROGRAM_CHARS, MAX_MAGNITUDE = 4000, 10 ** 30
_FOLD_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
             ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


@dataclass
class VoteTrace:
    """One problem: class id and token count per completion, in recorded order."""

    id: str
    ids: list[int | None]
    tokens: list[int]
    correct: list[bool] | None = None  # per class id: equals the gold answer
    answers: list[str | None] | None = None  # the extracted answer per completion
    texts: list[str] | None = None  # the completions
    recorded: bool = False  # tokens counted from recorded ids (evals record), not by a tokenizer

    @property
    def share(self) -> float:
        votes = [i for i in self.ids if i is not None]
        return max(votes.count(i) for i in set(votes)) / len(votes) if votes else 1.0


def program_answer(text: str | None) -> str | None:
    """The number a program-of-thought completion assigns to ``ans``, by
    constant folding; None when it cannot be had that way.

    The program is parsed (``ast.parse``) and never run: only straight-line
    assignments to names of int/float literals, names assigned before, unary
    -/+ and + - * / // % (** with a small integer exponent) are folded, in exact
    fractions; anything else (calls, attributes, loops, imports, comparisons,
    tuples), division by zero and huge numbers make the answer None."""
    if not text or len(text) > MAX_PROGRAM_CHARS:
        return None
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    env: dict[str, Fraction] = {}
    for stmt in tree.body:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)):
            return None
        try:
            env[stmt.targets[0].id] = value = _fold(stmt.value, env, 0)
        except (ZeroDivisionError, OverflowError, ValueError):
            return None
        if value is None:
            return None
    ans = env.get("ans")
    return None if ans is None else str(ans.numerator) if ans.denominator == 1 \
        else format(float(ans), ".10g")


def _fold(node, env: dict[str, Fraction], depth: int) -> Fraction | None:
    if depth > 50:
        return None
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool
        value = Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    elif isinstance(node, ast.Name):
        value = env.get(node.id)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _fold(node.operand, env, depth + 1)
        value = None if inner is None else (-inner if isinstance(node.op, ast.USub) else inner)
    elif isinstance(node, ast.BinOp):
        left, right = _fold(node.left, env, depth + 1), _fold(node.right, env, depth + 1)
        if left is None or right is None:
            return None
        if isinstance(node.op, ast.Pow):  # small integer exponents only
            ok = right.denominator == 1 and abs(right) <= 64 and abs(left) <= 10 ** 6
            value = left ** int(right) if ok else None
        else:
            op = _FOLD_OPS.get(type(node.op))
            value = None if op is None else Fraction(op(left, right))
    else:
        return None
    ok = value is not None and max(abs(value.numerator), value.denominator) <= MAX_MAGNITUDE
    return value if ok else None


def winner(ids) -> int | None:
    """The class the vote of ``ids`` picks (ties: the lowest path); None without answers."""
    ranked = tally(ids)
    return ranked[0][0] if ranked else None


def path_planner(problems: int, n: int, schedule, rule):
    """The engine's :class:`PathPlanner` over ``problems`` of ``n`` paths,
    voting with ``rule`` after each wave (None: no early stop)."""
    from consensus_spec.sampling.waves import PathPlanner

    def check(p, answers, remaining):
        return should_stop_ids(answers, remaining, rule)

    return PathPlanner(problems, n, schedule, check if rule is not None else None)


def gold_classes(answers: list, gold) -> tuple[list[int | None], list[bool] | None]:
    """Answers clustered into class ids (None: no answer), and per class
    whether its first answer equals ``gold`` (None when there is no gold)."""
    ids = cluster_answers(answers)
    if gold is None or not str(gold).strip():
        return ids, None
    reps: dict[int, str] = {}
    for a, i in zip(answers, ids):
        if i is not None:
            reps.setdefault(i, a)
    return ids, [answers_equal(reps[i], str(gold)) for i in range(len(reps))]


def answer_classes(plain: dict) -> list[tuple[list, list[int], list[bool]]]:
    """Per problem of a ``python -m evals math`` row run all at once: (class
    ids in path order, tokens, per class: correct); cached on the row
    (clustering calls math-verify)."""
    cached = plain.get("_classes")
    if cached is None:
        cached = []
        for p in plain["per_problem"]:
            ids, correct = gold_classes(p["answers"], p["gold"])
            cached.append((ids, p["sample_tokens"], correct or [False] * len(set(ids) - {None})))
        plain["_classes"] = cached
    return cached


def answer_extractor(path: str):
    """The extractor for a trace file's texts: :func:`program_answer` for
    program-of-thought files (``*_pot_*``), else ``extract_answer``."""
    return program_answer if "_pot_" in os.path.basename(path) else extract_answer


def load_vote_traces(path: str, tokenizer, limit: int | None = None, skip_bad: bool = False,
                     log=None) -> list[VoteTrace]:
    """The problems of a trace file with two or more completions, as votes
    (:class:`~evals.traces.TraceLines`: a bad line is an error unless
    ``skip_bad``).  Answers by :func:`program_answer` in program-of-thought
    files (``*_pot_*``), else by ``extract_answer``."""
    extract = answer_extractor(path)
    lines, out = TraceLines(path, skip_bad), []
    for lineno, obj in lines:
        if limit is not None and len(out) >= limit:
            break
        comps = completion_texts(obj)
        if len(comps) < 2:
            lines.skip("fewer than 2 non-empty completions")
            continue
        answers = [extract(c) for c in comps]
        ids, correct = gold_classes(answers, obj.get("answer"))
        ids_of = obj.get("completion_ids")  # python -m evals record: no tokenizer needed
        recorded = isinstance(ids_of, list) and len(ids_of) == len(comps) \
            and all(isinstance(r, list) for r in ids_of)
        tokens = [max(len(r), 1) for r in ids_of] if recorded else \
            [len(e.ids) + 1 for e in tokenizer.encode_batch(comps)]  # + EOS
        out.append(VoteTrace(trace_id(obj, lineno), ids, tokens, correct, answers, comps, recorded))
    lines.report(log)
    return out
