"""Replay adaptive stopping rules for self-consistency on recorded traces.

    python -m evals stop-rules [--traces FILE ...] [--limit N] [--perms 20]
                             [--waves 2] [--out results/stopping.json] [--plot PNG]
                             [--per-problem]
    python -m evals stop-rules --from-json results/stopping.json [--out ...] [--plot PNG]

Each problem's recorded completions are answered and clustered once
(:func:`~evals.adaptive.vote_traces.load_vote_traces`); samples are then fed
to a rule in recorded order, in ``--perms`` seeded random orders and
shortest-first (the order paths finish in when all run at once), and the
problem stops when the rule says so.  A consumed sample counts all its tokens
(GPT-2 BPE + EOS, as in :mod:`evals.traces`); the rule is checked only after
whole waves (default waves of 2, as the default ``Schedule``; ``--waves 1``:
after every path), and every sample of a started wave counts.

Prints a markdown table per set and rule and the leave-one-set-out tables
(:mod:`evals.adaptive.stop_rules_cv`), writes them next to a JSON file of all
figures (per set also the sample counts after which rules were checked,
``looks``, and whether each rule meets the targets, ``meets``; with
``--per-problem`` each problem's answers, class ids, token counts and gold
classes), and names the default rule the cross-validation supports.
``--from-json`` replays nothing: it redoes the selection on a saved result.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time

from consensus_spec.sampling.stopping import StopRule, should_stop_ids

from ..options import add_trace_args, trace_sets, write_json
from ..traces import load_tokenizer
from .stop_rules_cv import GUARANTEED, choose_default, loso, markdown, meets, pct, plot, summary
from .vote_traces import VoteTrace, load_vote_traces

DEFAULT_TRACES = ("gsm8k_qwen3_4b_n8.jsonl", "addsub_codex002_n40.jsonl", "svamp_pot_codex002_n30.jsonl")
HARD_SHARE = 0.6  # full-N winner share below this marks a hard problem


def parse_waves(spec: list[str]) -> list[int | None]:
    """``["1", "2", "4", "rest"]`` -> ``[1, 2, 4, None]`` (None: all the rest)."""
    for i, w in enumerate(spec):
        if not (w.isdigit() and int(w) >= 1 or w == "rest" and i == len(spec) - 1):
            raise ValueError(f"--waves takes sizes >= 1 and a final 'rest', got {w!r}")
    return [None if w == "rest" else int(w) for w in spec]


def checkpoints(n: int, waves: list[int | None]) -> list[int]:
    """Sample counts after which the rule is checked (before the last sample)."""
    from consensus_spec.sampling.waves import REST, Schedule
    return wave_ends(Schedule(waves=tuple(REST if w is None else w for w in waves)).sizes(n), n)


def wave_ends(sizes: list[int], n: int) -> list[int]:
    """Paths done after each wave of ``sizes`` but the last: where the vote is taken."""
    return [end for end in itertools.accumulate(sizes) if end < n]


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
    used = next((k for k in checks if should_stop_ids(ids[:k], n - k, rule, ranked=tallies[k])), n)
    winner = lambda t: t[0][0] if t else None  # noqa: E731
    return used, sum(tokens[:used]), winner(tallies[used]), winner(tallies[n])


def orders(trace: VoteTrace, perms: int, seed: int) -> dict[str, list[int]]:
    n = len(trace.ids)
    rng = random.Random(f"{seed}-{trace.id}")
    return {"recorded": list(range(n)), "shortest": sorted(range(n), key=lambda i: (trace.tokens[i], i)),
            **{f"perm{r}": rng.sample(range(n), n) for r in range(perms)}}


def evaluate(traces: list[VoteTrace], rules: list[StopRule], perms: int, seed: int,
             waves: list[int | None]) -> dict[str, dict]:
    """Per rule: metrics for recorded order, shortest-first, and the permutations."""
    hard = [t.share < HARD_SHARE for t in traces]
    full_tokens = sum(sum(t.tokens) for t in traces)
    n_samples = sum(len(t.ids) for t in traces)
    prepared: dict[str, list] = {}  # per order, per trace: (ids, tokens, checks, tallies)
    for t in traces:
        for name, order in orders(t, perms, seed).items():
            ids = [t.ids[i] for i in order]
            prepared.setdefault(name, []).append(
                (ids, [t.tokens[i] for i in order], checkpoints(len(ids), waves), prefix_tallies(ids)))
    results = {}
    for rule in rules:
        by_order = {}
        for name, per in prepared.items():
            runs = [replay_order(ids, tokens, rule, checks, tallies) for ids, tokens, checks, tallies in per]
            used = sum(r[0] for r in runs)
            agree = [stopped == full for _, _, stopped, full in runs]
            graded = [(t.correct, stopped, full) for t, (_, _, stopped, full) in zip(traces, runs)
                      if t.correct is not None]
            gold_stop = sum(s is not None and c[s] for c, s, _ in graded)
            gold_full = sum(f is not None and c[f] for c, _, f in graded)
            by_order[name] = {
                "samples_per_problem": used / len(traces), "samples_frac": used / n_samples,
                "tokens_frac": sum(r[1] for r in runs) / full_tokens, "agreement": sum(agree) / len(traces),
                "hard_agreement": sum(a and h for a, h in zip(agree, hard)) / sum(hard) if any(hard) else None,
                "gold_acc": gold_stop / len(graded) if graded else None,
                "gold_acc_full": gold_full / len(graded) if graded else None,
            }
        perm = [v for k, v in by_order.items() if k.startswith("perm")]
        summary = {**by_order["recorded"], "shortest_first": by_order["shortest"]}
        for key, worst in (("agreement", min), ("hard_agreement", min), ("tokens_frac", max),
                           ("gold_acc", min), ("gold_acc_full", min)):  # --perms >= 1
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
    ap = argparse.ArgumentParser(prog="python -m evals stop-rules", description=__doc__.split("\n\n")[0])
    add_trace_args(ap)
    ap.add_argument("--perms", type=int, default=20, help="random sample orders per problem")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--waves", nargs="+", metavar="SIZE", default=["2"],
                    help="check only after waves of these sizes, e.g. 1 2 4 rest (default: 2, as the "
                         "default Schedule; 1: after every sample)")
    ap.add_argument("--out", default="results/stopping.json", help="JSON path (markdown next to it)")
    ap.add_argument("--plot", help="PNG path for tokens against agreement per set and rule")
    ap.add_argument("--per-problem", action="store_true",
                    help="also write each problem's answers, class ids, token counts and gold classes")
    ap.add_argument("--from-json", metavar="FILE",
                    help="redo only the selection (targets, leave-one-set-out, default) on the per-set "
                         "figures of a saved result; replays nothing")
    args = ap.parse_args(argv)
    if args.from_json and args.traces:
        ap.error("--from-json takes its sets from the saved result: no --traces")
    if args.limit is not None and args.limit < 1 or args.perms < 1:
        ap.error("--limit must be >= 1 and --perms >= 1")
    try:
        args.waves = parse_waves(args.waves)
    except ValueError as e:
        ap.error(str(e))
    return args


def describe_looks(waves) -> str:
    return "waves " + ",".join("rest" if w is None else str(w) for w in waves) if waves else "every path"


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    if args.from_json:
        return from_json(args, start)
    tokenizer = load_tokenizer(args.tokenizer)
    rules = grid()
    sets, skipped = {}, {}
    for name, path in trace_sets(args.traces, DEFAULT_TRACES):
        traces = load_vote_traces(path, tokenizer, args.limit)
        if not any(i is not None for t in traces for i in t.ids):
            skipped[name] = "no extractable answers"
            print(f"skipping {name}: no extractable answers")
            continue
        t0 = time.perf_counter()
        sets[name] = {"problems": len(traces), "n": max(len(t.ids) for t in traces),
                      "hard_problems": sum(t.share < HARD_SHARE for t in traces),
                      "full_tokens": sum(sum(t.tokens) for t in traces),
                      "looks": {str(n): checkpoints(n, args.waves) for n in sorted({len(t.ids) for t in traces})},
                      "rules": evaluate(traces, rules, args.perms, args.seed, args.waves)}
        if args.per_problem:
            sets[name]["per_problem"] = [{"id": t.id, "answers": t.answers, "ids": t.ids, "tokens": t.tokens,
                                          "correct": t.correct, "share": t.share} for t in traces]
        print(f"{name}: {len(traces)} problems, replayed {len(rules)} rules in "
              f"{time.perf_counter() - t0:.1f}s")
    if not sets:
        print("no trace set with extractable answers")
        return 1
    return select(args, sets, skipped, HARD_SHARE, describe_looks(args.waves), start)


def from_json(args, start: float) -> int:
    """The selection redone on a saved result's per-set figures."""
    try:
        with open(args.from_json, encoding="utf-8") as f:
            saved = json.load(f)
        sets = saved["sets"]
        if not isinstance(sets, dict) or not sets:
            raise ValueError("no sets")
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"python -m evals stop-rules: error: {args.from_json}: not a saved stop-rules result ({e})",
              file=sys.stderr)
        return 2
    saved_args = saved.get("args") if isinstance(saved.get("args"), dict) else {}
    waves = saved_args.get("waves", [2])
    return select(args, sets, saved.get("skipped", {}), saved.get("hard_share", HARD_SHARE),
                  describe_looks(waves), start)


def select(args, sets: dict, skipped: dict, hard_share: float, looks: str, start: float) -> int:
    """Targets, leave-one-set-out and the default on per-set figures; tables, plot and JSON."""
    folds, folds_any = loso(sets, GUARANTEED), loso(sets)
    chosen = choose_default(sets, folds)
    text = markdown(sets, chosen, folds, folds_any)
    print()
    print(text)
    table = summary(sets)
    print(f"\ndefault by leave-one-set-out: {chosen} (mean tokens {pct(table[chosen]['tokens_frac_mean'])}% "
          f"of full-N over the sets; wall {time.perf_counter() - start:.1f}s)")
    if args.plot and plot(sets, chosen, args.plot, looks):
        print(f"wrote {args.plot}")
    if args.out:
        meets_by_set = {name: {r: meets(v) for r, v in s["rules"].items()} for name, s in sets.items()}
        write_json(args.out, {"args": vars(args), "hard_share": hard_share, "skipped": skipped,
                              "sets": sets, "selection": table, "loso": folds,
                              "loso_any_rule": folds_any, "default": chosen, "meets": meets_by_set})
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.out}")
    return 0
