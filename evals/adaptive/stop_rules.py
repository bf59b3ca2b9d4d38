"""Replay adaptive stopping rules on recorded traces, ours beside the peers'.

    python -m evals stop-rules [--traces FILE ...] [--limit N] [--perms 20]
                             [--waves 1] [--out results/stopping.json] [--plot PNG]
                             [--per-problem] [--prior others|shipped|JSON] [--write-prior JSON]
    python -m evals stop-rules --from-json results/stopping.json [--out ...] [--plot PNG]

Each problem's recorded completions are answered and clustered once
(:func:`~evals.adaptive.vote_traces.load_vote_traces`); samples are then fed
to a rule in recorded order, in ``--perms`` seeded random orders and
shortest-first (the order paths finish in when all run at once), and the
problem stops when the rule says so.  A consumed sample counts all its tokens
(GPT-2 BPE + EOS, as in :mod:`evals.traces`).  Our rules look after every
path (``--waves 1``, as the default ``Schedule`` votes in path order) or
after whole waves (``--waves 2``: every sample of a started wave counts);
the peers' kinds (``adaptive``, ``esc``, ``consol``) always get the looks
their authors' code takes (every path; ESC's windows are part of its rule).

Each order is a run: the problems in file order, and a ``bayes`` rule's
prior learns from the ones already finished in that run, as
``self_consistency`` does (``... static``: the shipped-style prior alone, as
``should_stop`` without a prior).  The prior a set starts from is never
fitted on that set: for the per-set figures it is fitted on the other sets
(uniform with one set), and inside each leave-one-set-out fold the tuning
sets' figures come from priors fitted on the other tuning sets only.

Agreement is with the full-N vote, a tie in it counting for any of its
leaders.  Prints the tables (:mod:`evals.adaptive.stop_rules_cv`), writes
them next to a JSON file of all figures, and names the default rule the
cross-validation supports.  ``--write-prior`` fits the prior on every set
given, writes it and replays nothing (the package's ``answer_prior.json``
is made so: ``--write-prior consensus_spec/sampling/answer_prior.json``);
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
from dataclasses import dataclass

from consensus_spec.sampling.answer_prior import AnswerPrior
from consensus_spec.sampling.stopping import PEERS, StopRule, should_stop_ids, stop_answer

from ..options import add_trace_args, trace_sets, write_json
from ..traces import load_tokenizer
from .stop_rules_cv import (FOLD_TITLES, GUARANTEED, OURS, choose_default, loso, markdown, meets,
                            nested_sources, pct, plot, summary)
from .vote_traces import VoteTrace, load_vote_traces

DEFAULT_TRACES = ("gsm8k_qwen3_4b_n8.jsonl", "addsub_codex002_n40.jsonl", "svamp_pot_codex002_n30.jsonl")
HARD_SHARE = 0.6  # full-N winner share below this marks a hard problem
BAYES_ERRORS = (0.001, 0.002, 0.003, 0.005, 0.01)


@dataclass(frozen=True)
class Candidate:
    """A rule as the replay runs it; ``learn``: a ``bayes`` run's prior
    learns from its finished problems."""

    rule: StopRule
    learn: bool = True

    @property
    def name(self) -> str:
        static = self.rule.kind == "bayes" and not self.learn
        return self.rule.describe() + (" static" if static else "")


def grid() -> list[Candidate]:
    rules = [StopRule(kind="bayes", error=e) for e in BAYES_ERRORS]
    rules += [StopRule(kind="decided")]
    rules += [StopRule(kind="sequential", error=e) for e in (0.05, 0.1, 0.2)]
    rules += [StopRule(kind="predictive", error=e) for e in (0.01, 0.05)]
    rules += [StopRule(kind="beta", error=0.05), StopRule(kind="window", window=3),
              StopRule(kind="window", window=4), StopRule(kind="margin", margin=3)]
    rules += [StopRule(kind="adaptive", error=e) for e in (0.05, 0.02, 0.1)]  # published: 0.05
    rules += [StopRule(kind="esc"), StopRule(kind="consol")]
    out = [Candidate(r) for r in rules]
    return out + [Candidate(StopRule(kind="bayes", error=e), learn=False) for e in BAYES_ERRORS]


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


def winners(ranked: list[tuple[int, int]]) -> frozenset:
    """Every class tied for the most votes (empty: nobody voted)."""
    return frozenset(c for c, v in ranked if v == ranked[0][1]) if ranked else frozenset()


def replay_order(ids, tokens, rule: StopRule, checks: list[int], tallies=None, prior=None):
    """(samples used, tokens used, the class it answers, the full-N vote's
    leaders) for one order; ``prior``: a ``bayes`` rule's."""
    n = len(ids)
    tallies = tallies or prefix_tallies(ids)
    spent = list(itertools.accumulate(tokens, initial=0))
    used = next((k for k in checks if should_stop_ids(ids[:k], n - k, rule, ranked=tallies[k],
                                                      prior=prior, length=spent[k] / k)), n)
    return used, spent[used], stop_answer(ids[:used], rule), winners(tallies[n])


def orders(trace: VoteTrace, perms: int, seed: int) -> dict[str, list[int]]:
    n = len(trace.ids)
    rng = random.Random(f"{seed}-{trace.id}")
    return {"recorded": list(range(n)), "shortest": sorted(range(n), key=lambda i: (trace.tokens[i], i)),
            **{f"perm{r}": rng.sample(range(n), n) for r in range(perms)}}


def full_votes(traces: list[VoteTrace]) -> list[tuple[list[int], int]]:
    """Per problem, (votes per answer class, paths without an answer) over all its paths."""
    return [([c for _, c in prefix_tallies(t.ids)[-1]], t.ids.count(None)) for t in traces]


def fit_prior(groups: list[list]) -> AnswerPrior:
    """Fitted on the sets' votes pooled (uniform when there is none)."""
    votes = [v for g in groups for v in g]
    return AnswerPrior.fit(votes) if votes else AnswerPrior.uniform()


def prepare(traces: list[VoteTrace], perms: int, seed: int, waves: list[int | None]) -> dict:
    """Per order, per trace: (ids, tokens, our looks, every look, prefix tallies)."""
    prepared: dict[str, list] = {}
    for t in traces:
        for name, order in orders(t, perms, seed).items():
            ids = [t.ids[i] for i in order]
            n = len(ids)
            prepared.setdefault(name, []).append(
                (ids, [t.tokens[i] for i in order], checkpoints(n, waves), list(range(1, n)),
                 prefix_tallies(ids)))
    return prepared


def evaluate(traces: list[VoteTrace], prepared: dict, candidates: list[Candidate],
             base: AnswerPrior) -> dict[str, dict]:
    """Per candidate: figures for recorded order, shortest-first and the
    random orders (each order a run, in problem order)."""
    hard = [t.share < HARD_SHARE for t in traces]
    full_tokens = sum(sum(t.tokens) for t in traces)
    n_samples = sum(len(t.ids) for t in traces)
    results = {}
    for cand in candidates:
        rule = cand.rule
        by_order = {}
        for name, per in prepared.items():
            prior = AnswerPrior(base.components, base.base_mix, learn=cand.learn) \
                if rule.kind == "bayes" else None
            runs, waits = [], []
            for ids, tokens, ours, every, tallies in per:
                run = replay_order(ids, tokens, rule, every if rule.kind in PEERS else ours, tallies, prior)
                runs.append(run)
                # alone on an engine, every path at once, a token a step: the answer waits for
                # the longest path voted on, a full vote for the longest of all
                waits.append(max(tokens[:run[0]]) / max(max(tokens), 1))
                if prior is not None:  # the run's prior sees the problem's final vote
                    counts = [c for _, c in tallies[run[0]]]
                    prior.observe(counts, run[0] - sum(counts), run[1] / run[0])
            agree = [stopped in full if full else stopped is None for _, _, stopped, full in runs]
            graded = [(t.correct, stopped, full) for t, (_, _, stopped, full) in zip(traces, runs)
                      if t.correct is not None]
            gold_stop = sum(s is not None and c[s] for c, s, _ in graded)
            gold_full = sum(bool(f) and c[min(f)] for c, _, f in graded)
            used = sum(r[0] for r in runs)
            by_order[name] = {
                "samples_per_problem": used / len(traces), "samples_frac": used / n_samples,
                "tokens_frac": sum(r[1] for r in runs) / full_tokens, "agreement": sum(agree) / len(traces),
                "answer_wait_frac": sum(waits) / len(waits),
                "hard_agreement": sum(a and h for a, h in zip(agree, hard)) / sum(hard) if any(hard) else None,
                "gold_acc": gold_stop / len(graded) if graded else None,
                "gold_acc_full": gold_full / len(graded) if graded else None,
            }
        perm = [v for k, v in by_order.items() if k.startswith("perm")]
        summary_ = {**by_order["recorded"], "shortest_first": by_order["shortest"]}
        for key, worst in (("agreement", min), ("hard_agreement", min), ("tokens_frac", max),
                           ("answer_wait_frac", max),
                           ("gold_acc", min), ("gold_acc_full", min)):  # --perms >= 1
            vals = [p[key] for p in perm if p[key] is not None]
            summary_[f"{key}_perm_mean"] = sum(vals) / len(vals) if vals else None
            summary_[f"{key}_perm_worst"] = worst(vals) if vals else None
        results[cand.name] = {"rule": {**rule.__dict__, "learn": cand.learn}, **summary_}
    return results


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m evals stop-rules", description=__doc__.split("\n\n")[0])
    add_trace_args(ap)
    ap.add_argument("--perms", type=int, default=20, help="random sample orders per problem")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--waves", nargs="+", metavar="SIZE", default=["1"],
                    help="our rules look after waves of these sizes, e.g. 2, or 1 2 4 rest (default 1: "
                         "after every path, as the default Schedule votes in path order)")
    ap.add_argument("--out", default="results/stopping.json", help="JSON path (markdown next to it)")
    ap.add_argument("--plot", help="PNG path for tokens against agreement per set and rule")
    ap.add_argument("--per-problem", action="store_true",
                    help="also write each problem's answers, class ids, token counts and gold classes")
    ap.add_argument("--write-prior", metavar="JSON",
                    help="fit the answer prior on every set given, write it there, replay nothing")
    ap.add_argument("--prior", default="others", metavar="others|shipped|JSON",
                    help="the prior each run starts from: fitted on the other sets given (default; "
                         "cross-validation), the package's shipped one, or a --write-prior file")
    ap.add_argument("--from-json", metavar="FILE",
                    help="redo only the selection (targets, leave-one-set-out, default) on the per-set "
                         "figures of a saved result; replays nothing")
    args = ap.parse_args(argv)
    if args.from_json and (args.traces or args.write_prior):
        ap.error("--from-json takes its sets from the saved result: no --traces or --write-prior")
    if args.limit is not None and args.limit < 1 or args.perms < 1:
        ap.error("--limit must be >= 1 and --perms >= 1")
    try:
        args.waves = parse_waves(args.waves)
    except ValueError as e:
        ap.error(str(e))
    return args


def describe_looks(waves) -> str:
    return "every path" if waves == [1] else "waves " + ",".join("rest" if w is None else str(w) for w in waves)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    if args.from_json:
        return from_json(args, start)
    tokenizer = load_tokenizer(args.tokenizer)
    candidates = grid()
    bayes = [c for c in candidates if c.rule.kind == "bayes"]
    loaded, skipped = {}, {}
    for name, path in trace_sets(args.traces, DEFAULT_TRACES):
        traces = load_vote_traces(path, tokenizer, args.limit, args.skip_bad_lines)
        if not any(i is not None for t in traces for i in t.ids):
            skipped[name] = "no extractable answers"
            print(f"skipping {name}: no extractable answers")
            continue
        loaded[name] = traces
    if not loaded:
        print("no trace set with extractable answers")
        return 1
    votes = {name: full_votes(traces) for name, traces in loaded.items()}
    fixed = None
    if args.prior != "others":
        try:
            fixed = AnswerPrior.default() if args.prior == "shipped" else \
                AnswerPrior.from_json(json.loads(open(args.prior, encoding="utf-8").read()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"python -m evals stop-rules: error: --prior {args.prior}: {e}", file=sys.stderr)
            return 2

    def prior_from(names) -> AnswerPrior:
        return fixed or fit_prior([votes[s] for s in names])

    if args.write_prior:
        write_json(args.write_prior, fit_prior(list(votes.values())).to_json(), indent=None)
        print(f"wrote {args.write_prior} (fitted on {', '.join(votes)})")
        return 0
    sets = {}
    for name, traces in loaded.items():
        t0 = time.perf_counter()
        prepared = prepare(traces, args.perms, args.seed, args.waves)
        own, *tuning = nested_sources(list(loaded))[name]
        sets[name] = {"problems": len(traces), "n": max(len(t.ids) for t in traces),
                      "hard_problems": sum(t.share < HARD_SHARE for t in traces),
                      "full_tokens": sum(sum(t.tokens) for t in traces),
                      "prior_from": args.prior if fixed else list(own),
                      "looks": {str(n): checkpoints(n, args.waves) for n in sorted({len(t.ids) for t in traces})},
                      "rules": evaluate(traces, prepared, candidates, prior_from(own)),
                      "tuning": {} if fixed else {"+".join(src): evaluate(traces, prepared, bayes,
                                                                          prior_from(src))
                                                  for src in tuning}}
        if args.per_problem:
            sets[name]["per_problem"] = [{"id": t.id, "answers": t.answers, "ids": t.ids, "tokens": t.tokens,
                                          "correct": t.correct, "share": t.share} for t in traces]
        print(f"{name}: {len(traces)} problems, replayed {len(candidates)} rules in "
              f"{time.perf_counter() - t0:.1f}s")
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
    waves = saved_args.get("waves", [1])
    return select(args, sets, saved.get("skipped", {}), saved.get("hard_share", HARD_SHARE),
                  describe_looks(waves), start)


def select(args, sets: dict, skipped: dict, hard_share: float, looks: str, start: float) -> int:
    """Targets, leave-one-set-out and the default on per-set figures; tables, plot and JSON."""
    folds = {"loso": loso(sets, OURS), "loso_guaranteed": loso(sets, GUARANTEED),
             "loso_any_rule": loso(sets)}
    chosen = choose_default(sets, folds["loso"])
    text = markdown(sets, chosen, dict(zip(FOLD_TITLES, folds.values())))
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
                              "sets": sets, "selection": table, **folds, "default": chosen,
                              "meets": meets_by_set})
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.out}")
    return 0
