"""Replay adaptive stopping rules for self-consistency on recorded traces.

    python -m evals stopping [--traces FILE ...] [--limit N] [--perms 20]
                             [--waves 1 2 4 rest] [--out results/stopping.json]

Each problem's recorded completions are answered with ``extract_answer`` and
clustered once (``cluster_answers``); samples are then fed to a rule in
recorded order, in ``--perms`` seeded random orders and shortest-first (the
order paths finish in when all run at once), and the problem stops when the
rule says so.  A consumed sample counts all its tokens (GPT-2 BPE + EOS, as
in :mod:`evals.traces`); with ``--waves`` the rule is checked only after whole
waves, and every sample of a started wave counts.  Prints a markdown table,
writes it next to a JSON file of all figures, and picks the default rule:
fewest tokens subject to >= 99% agreement with the full-N vote on every set
(recorded order and worst permutation) and >= 97% on the hard problems.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass

from consensus_spec.voting.answers import answers_equal, extract_answer
from consensus_spec.sampling.stopping import StopRule, should_stop_ids
from consensus_spec.voting.vote import cluster_answers

from .traces import load_tokenizer, shared_path

DEFAULT_TRACES = ("gsm8k_qwen3_4b_n8.jsonl", "addsub_codex002_n40.jsonl", "svamp_pot_codex002_n30.jsonl")
SKIP = {"svamp_pot_codex002_n30.jsonl": "its completions are Python programs whose answer exists "
                                        "only by running them, and model output is never executed"}
HARD_SHARE = 0.6  # full-N winner share below this marks a hard problem
TARGET_AGREE, TARGET_HARD = 0.99, 0.97


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


def load_vote_traces(path: str, tokenizer, limit: int | None = None) -> list[VoteTrace]:
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
            ids, correct = gold_classes([extract_answer(c) for c in comps], obj.get("answer"))
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
            for key, worst in (("agreement", min), ("hard_agreement", min), ("tokens_frac", max)):
                vals = [p[key] for p in perm if p[key] is not None]
                summary[f"{key}_perm_mean"] = sum(vals) / len(vals) if vals else None
                summary[f"{key}_perm_worst"] = worst(vals) if vals else None
        results[rule.describe()] = {"rule": rule.__dict__, **summary}
    return results


def grid() -> list[StopRule]:
    rules = [StopRule(kind="decided")]
    for kind in ("predictive", "beta"):
        rules += [StopRule(kind=kind, error=e, min_samples=m)
                  for e in (0.01, 0.05, 0.1) for m in (2, 3, 4)]
    rules += [StopRule(kind="window", window=w) for w in (3, 4, 5)]
    rules += [StopRule(kind="margin", margin=m, min_samples=m) for m in (2, 3, 4)]
    return rules


def select(sets: dict[str, dict]) -> tuple[str, dict[str, dict]]:
    """The rule with the fewest mean tokens that meets the agreement targets."""
    table = {}
    for name in next(iter(sets.values()))["rules"]:
        rows = [s["rules"][name] for s in sets.values()]
        hard_n = [s["hard_problems"] for s in sets.values()]
        hard_vals = [r.get("hard_agreement_perm_mean", r["hard_agreement"]) for r in rows]
        pooled = [(v, n) for v, n in zip(hard_vals, hard_n) if v is not None and n]
        hard = sum(v * n for v, n in pooled) / sum(n for _, n in pooled) if pooled else None
        agree_ok = all(r["agreement"] >= TARGET_AGREE and
                       r.get("agreement_perm_worst", 1.0) >= TARGET_AGREE for r in rows)
        tokens = sum(r.get("tokens_frac_perm_mean", r["tokens_frac"]) for r in rows) / len(rows)
        table[name] = {"tokens_frac_mean": tokens, "hard_agreement_pooled": hard,
                       "passes": agree_ok and (hard is None or hard >= TARGET_HARD)}
    rules = next(iter(sets.values()))["rules"]
    passing = [n for n, v in table.items() if v["passes"]] or ["decided"]
    # Equal cost (e.g. min_samples that never binds): take the more cautious rule.
    return min(passing, key=lambda n: (round(table[n]["tokens_frac_mean"], 9),
                                       -rules[n]["rule"]["min_samples"], rules[n]["rule"]["error"])), table


def pct(x, digits=1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}"


def markdown(sets: dict[str, dict], chosen: str, table: dict[str, dict]) -> str:
    lines = ["| set | rule | samples/N % | tokens % rec / perm mean / worst | agree % rec / "
             "perm mean / worst | agree % shortest-first | hard agree % perm mean / worst (n) | "
             "gold % stopped / full-N |",
             "|---|---|---|---|---|---|---|---|"]
    for set_name, s in sets.items():
        for name, r in s["rules"].items():
            gold = "-" if r["gold_acc"] is None else f"{pct(r['gold_acc'])} / {pct(r['gold_acc_full'])}"
            mark = " **(default)**" if name == chosen else ""
            lines.append(
                f"| {set_name} | {name}{mark} | {pct(r['samples_frac'])} | "
                f"{pct(r['tokens_frac'])} / {pct(r.get('tokens_frac_perm_mean'))} / "
                f"{pct(r.get('tokens_frac_perm_worst'))} | {pct(r['agreement'], 2)} / "
                f"{pct(r.get('agreement_perm_mean'), 2)} / {pct(r.get('agreement_perm_worst'), 2)} | "
                f"{pct(r['shortest_first']['agreement'], 2)} | "
                f"{pct(r.get('hard_agreement_perm_mean'))} / {pct(r.get('hard_agreement_perm_worst'))} "
                f"({s['hard_problems']}) | {gold} |")
    lines += ["", "| rule | mean tokens % over sets (perm mean) | hard agree % pooled | meets targets |",
              "|---|---|---|---|"]
    for name, v in sorted(table.items(), key=lambda kv: kv[1]["tokens_frac_mean"]):
        mark = " **(default)**" if name == chosen else ""
        lines.append(f"| {name}{mark} | {pct(v['tokens_frac_mean'])} | "
                     f"{pct(v['hard_agreement_pooled'])} | {'yes' if v['passes'] else 'no'} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m evals stopping", description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", help="trace files (default: the shared traces)")
    ap.add_argument("--limit", type=int, help="first N problems of each set")
    ap.add_argument("--perms", type=int, default=20, help="random sample orders per problem")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--waves", nargs="+", metavar="SIZE",
                    help="check only after waves of these sizes, e.g. 1 2 4 rest (default: every sample)")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: shared GPT-2)")
    ap.add_argument("--out", default="results/stopping.json", help="JSON path (markdown next to it)")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1 or args.perms < 0:
        ap.error("--limit must be >= 1 and --perms >= 0")
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
        base = os.path.basename(path)
        name = base.removesuffix(".jsonl")
        if base in SKIP:
            skipped[name] = SKIP[base]
            print(f"skipping {name}: {SKIP[base]}")
            continue
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
    chosen, table = select(sets)
    text = markdown(sets, chosen, table)
    print()
    print(text)
    print(f"\ndefault by measurement: {chosen} (mean tokens {pct(table[chosen]['tokens_frac_mean'])}% "
          f"of full-N; wall {time.perf_counter() - start:.1f}s)")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "hard_share": HARD_SHARE,
                       "skipped": skipped, "sets": sets, "selection": table, "default": chosen},
                      f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.out}")
    return 0
