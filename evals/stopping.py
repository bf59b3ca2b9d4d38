"""Replay adaptive stopping rules for self-consistency on recorded traces.

    python -m evals stopping [--traces FILE ...] [--limit N] [--perms 20]
                             [--waves 2] [--out results/stopping.json] [--plot PNG]

Each problem's recorded completions are answered with ``extract_answer``
(program-of-thought sets, ``*_pot_*``: :func:`program_answer`, which folds the
arithmetic statically and never runs the program) and clustered once
(``cluster_answers``); samples are then fed to a rule in recorded order, in
``--perms`` seeded random orders and shortest-first (the order paths finish
in when all run at once), and the problem stops when the rule says so.  A
consumed sample counts all its tokens (GPT-2 BPE + EOS, as in
:mod:`evals.traces`); the rule is checked only after whole waves (default
waves of 2, as the default ``Schedule``; ``--waves 1``: after every path), and
every sample of a started wave counts.  Prints a markdown table per set and
rule (realized disagreement beside the nominal error), leave-one-set-out
tables (:mod:`evals.stopping_cv`), writes them next to a JSON file of all
figures, and names the default rule the cross-validation supports.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import random
import time
from dataclasses import dataclass
from fractions import Fraction

from consensus_spec.voting.answers import answers_equal, extract_answer
from consensus_spec.sampling.stopping import StopRule, should_stop_ids
from consensus_spec.voting.vote import cluster_answers

from .stopping_cv import GUARANTEED, choose_default, loso, markdown, pct, plot, summary
from .traces import load_tokenizer, shared_path

DEFAULT_TRACES = ("gsm8k_qwen3_4b_n8.jsonl", "addsub_codex002_n40.jsonl", "svamp_pot_codex002_n30.jsonl")
SKIP: dict[str, str] = {}  # none: program-of-thought answers are folded statically (program_answer)
HARD_SHARE = 0.6  # full-N winner share below this marks a hard problem
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


def load_vote_traces(path: str, tokenizer, limit: int | None = None, extract=None) -> list[VoteTrace]:
    """``extract``: completion -> answer (default: :func:`program_answer` for
    program-of-thought files, ``*_pot_*``, else ``extract_answer``)."""
    if extract is None:
        extract = program_answer if "_pot_" in os.path.basename(path) else extract_answer
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue  # blank or broken line: nothing to replay
            comps = obj.get("completions") if isinstance(obj, dict) else None
            comps = [c for c in comps or [] if isinstance(c, str) and c]
            if len(comps) < 2:
                continue
            ids, correct = gold_classes([extract(c) for c in comps], obj.get("answer"))
            recorded = obj.get("completion_ids")  # python -m evals record: no tokenizer needed
            if isinstance(recorded, list) and len(recorded) == len(comps):
                tokens = [max(len(r), 1) for r in recorded]
            else:
                tokens = [len(e.ids) + 1 for e in tokenizer.encode_batch(comps)]  # + EOS
            out.append(VoteTrace(str(obj.get("id", f"line{lineno}")), ids, tokens, correct))
    return out


def parse_waves(spec: list[str] | None) -> list[int | None] | None:
    """``["1", "2", "4", "rest"]`` -> ``[1, 2, 4, None]`` (None: all the rest)."""
    if not spec:
        return None
    waves: list[int | None] = []
    for i, w in enumerate(spec):
        if w == "rest" and i == len(spec) - 1:
            waves.append(None)
        elif w.isdigit() and int(w) >= 1:
            waves.append(int(w))
        else:
            raise ValueError(f"--waves takes sizes >= 1 and a final 'rest', got {w!r}")
    return waves


def checkpoints(n: int, waves: list[int | None] | None) -> list[int]:
    """Sample counts after which the rule is checked (before the last sample)."""
    if waves is None:
        return list(range(1, n))
    done, out, i = 0, [], 0
    while done < n:
        size = waves[min(i, len(waves) - 1)]  # the last size repeats
        done = n if size is None else min(n, done + size)
        out.append(done)
        i += 1
    return out[:-1]


def prefix_tallies(ids: list[int | None]) -> list[list[tuple[int, int]]]:
    """tally(ids[:k]) for k = 0..N, built incrementally (stable tie order)."""
    counts: dict[int, int] = {}
    out = [[]]
    for i in ids:
        if i is not None:
            counts[i] = counts.get(i, 0) + 1
        out.append(sorted(counts.items(), key=lambda kv: -kv[1]))
    return out


def replay_order(ids, tokens, rule: StopRule, checks: list[int], tallies=None):
    """(samples used, tokens used, stopped winner, full-N winner) for one order."""
    n = len(ids)
    tallies = tallies or prefix_tallies(ids)
    used = n
    for k in checks:
        if should_stop_ids(ids[:k], n - k, rule, ranked=tallies[k]):
            used = k
            break

    def winner(t):
        return t[0][0] if t else None

    return used, sum(tokens[:used]), winner(tallies[used]), winner(tallies[n])


def orders(trace: VoteTrace, perms: int, seed: int) -> dict[str, list[int]]:
    n = len(trace.ids)
    rng = random.Random(f"{seed}-{trace.id}")
    out = {"recorded": list(range(n)),
           "shortest": sorted(range(n), key=lambda i: (trace.tokens[i], i))}
    for r in range(perms):
        out[f"perm{r}"] = rng.sample(range(n), n)
    return out


def evaluate(traces: list[VoteTrace], rules: list[StopRule], perms: int = 20, seed: int = 0,
             waves: list[int | None] | None = None) -> dict[str, dict]:
    """Per rule: metrics for recorded order, shortest-first, and the permutations."""
    hard = [t.share < HARD_SHARE for t in traces]
    full_tokens = sum(sum(t.tokens) for t in traces)
    n_samples = sum(len(t.ids) for t in traces)
    prepared = []  # per trace, per order: (ids, tokens, tallies, checks)
    for t in traces:
        per = {}
        for name, order in orders(t, perms, seed).items():
            ids = [t.ids[i] for i in order]
            per[name] = (ids, [t.tokens[i] for i in order], prefix_tallies(ids),
                         checkpoints(len(ids), waves))
        prepared.append(per)
    names = list(prepared[0]) if prepared else []
    results = {}
    for rule in rules:
        by_order = {}
        for name in names:
            used = tok = agree = hard_agree = gold_stop = gold_full = 0
            graded = 0
            for t, per, is_hard in zip(traces, prepared, hard):
                ids, tokens, tallies, checks = per[name]
                u, k, stopped, full = replay_order(ids, tokens, rule, checks, tallies)
                used += u
                tok += k
                agree += stopped == full
                hard_agree += is_hard and stopped == full
                if t.correct is not None:
                    graded += 1
                    gold_stop += stopped is not None and t.correct[stopped]
                    gold_full += full is not None and t.correct[full]
            by_order[name] = {
                "samples_per_problem": used / len(traces), "samples_frac": used / n_samples,
                "tokens_frac": tok / full_tokens, "agreement": agree / len(traces),
                "hard_agreement": hard_agree / sum(hard) if any(hard) else None,
                "gold_acc": gold_stop / graded if graded else None,
                "gold_acc_full": gold_full / graded if graded else None,
            }
        perm = [v for k, v in by_order.items() if k.startswith("perm")]
        summary = dict(by_order["recorded"])
        summary["shortest_first"] = by_order["shortest"]
        if perm:
            for key, worst in (("agreement", min), ("hard_agreement", min), ("tokens_frac", max),
                               ("gold_acc", min), ("gold_acc_full", min)):
                vals = [p[key] for p in perm if p[key] is not None]
                summary[f"{key}_perm_mean"] = sum(vals) / len(vals) if vals else None
                summary[f"{key}_perm_worst"] = worst(vals) if vals else None
        results[rule.describe()] = {"rule": rule.__dict__, **summary}
    return results


def grid() -> list[StopRule]:
    rules = [StopRule(kind="decided")]
    rules += [StopRule(kind="sequential", error=e) for e in (0.01, 0.02, 0.05, 0.1, 0.2)]
    rules += [StopRule(kind="predictive", error=e) for e in (0.005, 0.01, 0.02, 0.05, 0.1)]
    rules += [StopRule(kind="beta", error=e) for e in (0.01, 0.05, 0.1)]
    rules += [StopRule(kind="window", window=w) for w in (3, 4, 5)]
    rules += [StopRule(kind="margin", margin=m, min_samples=m) for m in (2, 3, 4)]
    return rules


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m evals stopping", description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", help="trace files (default: the shared traces)")
    ap.add_argument("--limit", type=int, help="first N problems of each set")
    ap.add_argument("--perms", type=int, default=20, help="random sample orders per problem")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--waves", nargs="+", metavar="SIZE", default=["2"],
                    help="check only after waves of these sizes, e.g. 1 2 4 rest (default: 2, as the "
                         "default Schedule; 1: after every sample)")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: shared GPT-2)")
    ap.add_argument("--out", default="results/stopping.json", help="JSON path (markdown next to it)")
    ap.add_argument("--plot", help="PNG path for tokens against agreement per set and rule")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1 or args.perms < 1:
        ap.error("--limit must be >= 1 and --perms >= 1")
    try:
        args.waves = parse_waves(args.waves)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer)
    rules = grid()
    sets, skipped = {}, {}
    for path in args.traces or [shared_path("traces", t) for t in DEFAULT_TRACES]:
        name = os.path.basename(path).removesuffix(".jsonl")
        traces = load_vote_traces(path, tokenizer, args.limit)
        if not any(i is not None for t in traces for i in t.ids):
            skipped[name] = "no extractable answers"
            print(f"skipping {name}: no extractable answers")
            continue
        t0 = time.perf_counter()
        sets[name] = {"problems": len(traces), "n": max(len(t.ids) for t in traces),
                      "hard_problems": sum(t.share < HARD_SHARE for t in traces),
                      "full_tokens": sum(sum(t.tokens) for t in traces),
                      "rules": evaluate(traces, rules, args.perms, args.seed, args.waves)}
        print(f"{name}: {len(traces)} problems, replayed {len(rules)} rules in "
              f"{time.perf_counter() - t0:.1f}s")
    if not sets:
        print("no trace set with extractable answers")
        return 1
    folds, folds_any = loso(sets, GUARANTEED), loso(sets)
    chosen = choose_default(sets, folds)
    text = markdown(sets, chosen, folds, folds_any)
    print()
    print(text)
    table = summary(sets)
    print(f"\ndefault by leave-one-set-out: {chosen} (mean tokens {pct(table[chosen]['tokens_frac_mean'])}% "
          f"of full-N over the sets; wall {time.perf_counter() - start:.1f}s)")
    looks = "waves " + ",".join("rest" if w is None else str(w) for w in args.waves) \
        if args.waves else "every path"
    if args.plot and plot(sets, chosen, args.plot, looks):
        print(f"wrote {args.plot}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "hard_share": HARD_SHARE,
                       "skipped": skipped, "sets": sets, "selection": table, "loso": folds,
                       "loso_any_rule": folds_any, "default": chosen}, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.out}")
    return 0
