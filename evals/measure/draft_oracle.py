"""The best fixed draft length on this machine, end to end, and the budget's share of it.

    python -m evals [--isa avx2] draft-oracle [--dataset synthetic] [--limit 100] [--n 16]
                    [--max-num-seqs 16] [--ks 1 2 4 8] [--runs 3] [--out PREFIX]

The job of README command 1 (self-consistency, all n paths at once) with
each drafting setting on a fresh engine (a fresh process): ``none`` (K = 0),
``idle`` (the consensus proposer in the engine, never confident enough to
draft: ``cost_model=off``, ``min_prob=1``: what a speculative engine pays
when nothing is drafted, its row tracking and trie updates included),
consensus drafting with a fixed most-draft-tokens ``K`` and no budget
(``cost_model=off``: a row drafts up to K tokens whenever the drafter is
confident), and consensus drafting as shipped (``budget``: k = ``--k``, the
batch-aware budget). Each run takes every setting once, in an order that
rotates from run to run, so a drifting machine falls on every setting
alike. Per run it prints wall and CPU time over ``none``'s of the same run;
then, per setting, the median and range over runs. The oracle is the
fixed setting (K = 0 included) with the best median CPU ratio; the
budget's share is its CPU ratio over the oracle's, per run. Writes
PREFIX.json. The CPU time is this process's (the engine runs in it).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

from ..machine import python_loop_ns
from ..math.configs import Parser, UsageError, max_tokens
from ..math.llm import add_run_args, check_run_args, engine_env, load_run
from ..options import add_option_arg, fail, parse_options, write_json


def settings(ks: list[int], k: int, options: dict) -> list[tuple[str, str, int, dict]]:
    """(label, method, k, drafter options) per setting, ``none`` first."""
    out = [("none", "none", k, {}), ("idle", "consensus", k, {**options, "cost_model": "off", "min_prob": 1.0})]
    out += [(f"K={kk}", "consensus", kk, {**options, "cost_model": "off"}) for kk in ks]
    out.append(("budget", "consensus", k, options))
    return out


def run_setting(method: str, k: int, options: dict, args, problems, tokens: int) -> dict:
    from ..math.runs import isolated, run_configs
    from consensus_spec.sampling.waves import REST, Schedule

    a = copy.copy(args)
    a.k, a.drafter_options, a.n = k, options, [args.n]
    row = isolated(run_configs, method, [(args.n, Schedule(waves=(REST,)), None)], a, problems, tokens)[0]
    proposer = row.get("proposer") or {}
    return {"wall_s": row["wall_time_s"], "cpu_s": row["cpu_time_s"], "tokens": row["tokens"],
            "drafted": row["drafted_tokens"], "accepted": row["accepted_tokens"],
            "maj_at_n": row["maj_at_n"], "guard": proposer.get("guard"),
            "learning_cost": proposer.get("learning_cost"), "steps_timed": proposer.get("steps_timed"),
            "steps_unattributed": proposer.get("steps_unattributed"),
            "step_costs_by_rows": proposer.get("step_costs_by_rows")}


def summarise(runs: list[dict], labels: list[str]) -> dict:
    """Per setting: wall and CPU ratios over none per run; the oracle; the budget's share."""
    ratio = {lab: {"wall": [], "cpu": []} for lab in labels}
    for run in runs:
        base = run["none"]
        for lab in labels:
            r = run[lab]
            ratio[lab]["wall"].append(base["wall_s"] / r["wall_s"])
            ratio[lab]["cpu"].append(base["cpu_s"] / r["cpu_s"])
    fixed = [lab for lab in labels if lab not in ("budget", "idle")]
    oracle = max(fixed, key=lambda lab: statistics.median(ratio[lab]["cpu"]))
    share = [b / o for b, o in zip(ratio["budget"]["cpu"], ratio[oracle]["cpu"])] if "budget" in ratio else []
    return {"ratios": ratio, "oracle": oracle, "budget_share_of_oracle_cpu": share}


def main(argv=None) -> int:
    ap = Parser(prog="python -m evals draft-oracle", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="synthetic", help="as `evals math` (default synthetic)")
    add_run_args(ap)
    ap.add_argument("--n", type=int, default=16, help="paths per problem, all at once")
    ap.add_argument("--k", type=int, default=8, help="the budget's num_speculative_tokens")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8], help="fixed draft lengths")
    ap.add_argument("--runs", type=int, default=3, help="runs; each takes every setting once")
    ap.add_argument("--no-budget", action="store_true", help="the fixed settings only")
    add_option_arg(ap)
    ap.add_argument("--out", default="results/draft_oracle", help="output prefix (.json)")
    try:
        args = ap.parse_args(argv)
        check_run_args(args, ("limit", "k", "runs"))
        if min(args.ks) < 1:
            raise UsageError("--ks must be >= 1 (K = 0 is none, always run)")
        args.path_seeds = False
        options = parse_options(args.option)
        problems = load_run(args)
    except (UsageError, ValueError) as e:
        return fail(e)
    engine_env(args.verbose)
    tokens = max_tokens(args, problems)
    plan = settings(sorted(set(args.ks)), args.k, options)
    if args.no_budget:
        plan = plan[:-1]
    labels = [p[0] for p in plan]
    print(f"draft-oracle: {args.dataset}, {len(problems)} problems, n {args.n}, rows "
          f"{args.max_num_seqs or 'default'}, settings {' '.join(labels)}, {args.runs} runs; "
          f"Python loop {python_loop_ns():.1f} ns/iteration", file=sys.stderr, flush=True)
    runs = []
    for i in range(args.runs):
        order = plan[i % len(plan):] + plan[:i % len(plan)]
        if i % 2:
            order = order[::-1]
        run = {}
        for label, method, k, opts in order:
            run[label] = run_setting(method, k, opts, args, problems, tokens)
        runs.append(run)
        base = run["none"]
        print(f"run {i + 1} (order {' '.join(p[0] for p in order)}): " + ", ".join(
            f"{lab} {base['wall_s'] / run[lab]['wall_s']:.3f}/{base['cpu_s'] / run[lab]['cpu_s']:.3f}"
            for lab in labels) + "  (wall/CPU over none)", flush=True)
    summary = summarise(runs, labels)
    print("\n| setting | wall over none: median (range) | CPU over none: median (range) | drafted | accepted |")
    print("|---|---|---|---|---|")
    for lab in labels:
        w, c = summary["ratios"][lab]["wall"], summary["ratios"][lab]["cpu"]
        drafted = statistics.median(r[lab]["drafted"] for r in runs)
        accepted = statistics.median(r[lab]["accepted"] for r in runs)
        print(f"| {lab} | {statistics.median(w):.3f} ({min(w):.3f}-{max(w):.3f}) | "
              f"{statistics.median(c):.3f} ({min(c):.3f}-{max(c):.3f}) | {drafted:.0f} | {accepted:.0f} |")
    share = summary["budget_share_of_oracle_cpu"]
    print(f"\noracle (best median CPU ratio of the fixed settings): {summary['oracle']}"
          + (f"; budget's share of it per run (CPU): {', '.join(f'{s:.3f}' for s in share)}" if share else ""))
    write_json(args.out + ".json", {"args": {k: v for k, v in vars(args).items() if k != "option"},
                                    "options": options, "settings": labels, "runs": runs, **summary},
               default=str)
    print(f"wrote {args.out}.json")
    return 0
