"""Data-parallel replay: what splitting siblings across engines costs drafting.

    python -m evals dp-replay [--traces FILE ...] [--dp 1 2 8] [--rows 64]
                              [--methods consensus suffix] [--limit N] [--option KEY=VALUE]

Every problem's N recorded paths are routed to D engines, each its own
drafter replayed with ``rows / D`` batch rows, under ``round_robin`` or
``pinned`` (``data_parallel_rank``); ``one@rows/D`` is one engine at
``rows / D`` rows.  docs/parallelism.md ("Replay, D engines") says what each
is and why.  tau is tokens per verified row-step over all engines.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from consensus_spec.sampling.routing import data_parallel_rank

from ..options import add_option_arg, add_trace_args, fail, parse_options, trace_sets, write_results
from ..traces import Problem, TraceError, load_problems, load_tokenizer, max_len
from .drafters import make_drafter
from .engine import replay

DEFAULT_TRACES = ("gsm8k_qwen3_4b_n8.jsonl", "addsub_codex002_n40.jsonl", "svamp_pot_codex002_n30.jsonl")
ROUTINGS = ("round_robin", "pinned")


def route(problems: list[Problem], dp: int, routing: str) -> list[list[Problem]]:
    """Each engine's share: the problems it sees, each with only the
    completions (sibling paths) routed to it, in submission order."""
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    shares: list[list[Problem]] = [[] for _ in range(dp)]
    child = 0  # children submitted so far (the round-robin cursor)
    for prob in problems:
        paths: list[list[list[int]]] = [[] for _ in range(dp)]
        if routing == "round_robin":
            for comp in prob.completions:
                paths[child % dp].append(comp)
                child += 1
        elif routing == "pinned":
            paths[data_parallel_rank(prob.prompt, dp)] = list(prob.completions)
        else:
            raise ValueError(f"unknown routing {routing!r}; choose from {ROUTINGS}")
        for e in range(dp):
            if paths[e]:
                shares[e].append(replace(prob, completions=paths[e]))
    return shares


def replay_dp(problems: list[Problem], method: str, k: int, rows: int, dp: int, routing: str,
              length: int, options: dict | None = None) -> dict:
    """Replay the D engines one after another; totals over engines."""
    per_engine = rows // dp
    if per_engine < 1:
        raise ValueError(f"--rows {rows} leaves no row per engine at dp={dp}")
    totals = dict(row_steps=0, tokens=0, drafted=0, accepted=0)
    shares = route(problems, dp, routing)
    loads = [sum(len(p.completions) for p in share) for share in shares]  # paths per engine
    for share in shares:
        if not share:
            continue
        stats = replay(share, make_drafter(method, k, length, per_engine, options),
                       method, k, per_engine)
        for key in totals:
            totals[key] += getattr(stats, key)
    mean_load = sum(loads) / len(loads)
    return dict(method=method, dp=dp, routing=routing, rows_per_engine=per_engine, **totals,
                tau=totals["tokens"] / max(totals["row_steps"], 1),
                acceptance=totals["accepted"] / max(totals["drafted"], 1),
                load_max_over_mean=max(loads) / mean_load if mean_load else 0.0,
                shares=[[[p.id, len(p.completions)] for p in share] for share in shares])


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m evals dp-replay",
                                 description=__doc__.split("\n\n")[0])
    add_trace_args(ap)
    ap.add_argument("--methods", nargs="+", default=["consensus", "suffix"],
                    choices=["consensus", "suffix", "ngram"])
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 8], help="engine counts D")
    ap.add_argument("--rows", type=int, default=64, help="total batch rows, split over D engines")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    add_option_arg(ap, "consensus drafter option, e.g. cost_model=off (repeatable)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the one-engine@rows/D runs")
    ap.add_argument("--out", default="results/dp_replay", help="output prefix (.json and .md)")
    args = ap.parse_args(argv)
    if args.k < 1 or min(args.dp) < 1 or args.rows < 1:
        ap.error("--k, --dp and --rows must be >= 1")
    if any(args.rows // d < 1 for d in args.dp):
        ap.error("--rows must be >= every --dp (one row per engine at least)")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    return args


def run(args, log=print) -> list[dict]:
    tokenizer = load_tokenizer(args.tokenizer)
    options = parse_options(args.option)
    results = []
    for name, path in trace_sets(args.traces, DEFAULT_TRACES):
        problems = load_problems(path, tokenizer, limit=args.limit, skip_bad=args.skip_bad_lines)
        length = max_len(problems, args.k)
        for method in args.methods:
            for dp in args.dp:
                row = {"traces": name, "problems": len(problems), "method": method, "dp": dp,
                       "rows_per_engine": args.rows // dp}
                for routing in ROUTINGS:
                    if dp == 1 and routing != ROUTINGS[0]:
                        row[routing] = row[ROUTINGS[0]]  # one engine: routing changes nothing
                        continue
                    r = replay_dp(problems, method, args.k, args.rows, dp, routing, length, options)
                    row[routing] = r["tau"]
                    # shares: per engine, [problem id, paths routed to it] in submission order
                    row.update({f"{routing}_{key}": r[key] for key in (
                        "acceptance", "load_max_over_mean", "tokens", "row_steps", "shares")})
                if not args.no_baseline:
                    row["one_engine_rows_per_engine"] = (
                        row[ROUTINGS[0]] if dp == 1 else
                        replay_dp(problems, method, args.k, args.rows // dp, 1, "pinned",
                                  length, options)["tau"])
                log(f"{name} {method} D={dp}: " + ", ".join(
                    f"{key}={row[key]:.3f}" for key in (*ROUTINGS, "one_engine_rows_per_engine")
                    if key in row))
                results.append(row)
    return results


def markdown(results: list[dict], rows: int) -> str:
    lines = ["| traces | method | D | rows/engine | tau round-robin | tau pinned | "
             "tau one engine @ rows/D | pinned load max/mean |", "|" + "---|" * 8]
    for r in results:
        base = r.get("one_engine_rows_per_engine")
        lines.append(f"| {r['traces']} | {r['method']} | {r['dp']} | {r['rows_per_engine']} | "
                     f"{r['round_robin']:.2f} | {r['pinned']:.2f} | "
                     + (f"{base:.2f}" if base is not None else "-") + " | "
                     + (f"{r['pinned_load_max_over_mean']:.2f}" if "pinned_load_max_over_mean" in r
                        else "1.00") + " |")
    return "\n".join(lines) + f"\n\n(total rows {rows}, split evenly over the D engines)"


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        results = run(args)
    except (TraceError, FileNotFoundError, ValueError) as e:
        return fail(e)
    except ImportError as e:
        return fail(f"{e}. The suffix baseline needs arctic-inference; pass --methods consensus to skip it.")
    table = markdown(results, args.rows)
    print(table)
    write_results(args.out, {"args": vars(args), "results": results}, table)
    return 0
