"""Adaptive self-consistency with drafting, replayed: time to all answers.

    python -m evals waves [--traces FILE ...] [--rows 64] [--waves 2] [--fill on|off|both]
                          [--early-stop on decided ...] [--orders 3] [--limit N]

Each trace set runs through the replay (:mod:`evals.replay.engine`), the
engine's batch capped at ``--rows`` paths (vLLM's ``max_num_seqs``), as plain
self-consistency (all N paths of a problem at once) and as waves with each
stop rule (the :class:`~consensus_spec.sampling.waves.PathPlanner` that
``self_consistency`` drives), each without drafting and with consensus
drafting and its batch-aware budget.

A path's answer is the recorded completion's extracted answer, so the vote
after each wave is the one the engine would take.  Reported per run: paths
and tokens used, agreement with the full-N vote, gold maj accuracy, engine
steps, batch fill, τ, and the **projected** H200 time to all answers, step by
step (:func:`evals.replay.projection.run_ms`, with the drafter's CPU time
measured here; with ``--host-time``, runs without drafting hide the host time
and drafting runs pay it).  A projection, not a GPU measurement.

``--orders``: the recorded path order and seeded shuffles of it (stopping
depends on which answers come first); figures are given as mean and range.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import Counter
from dataclasses import replace

from ..options import (UsageError, add_option_arg, add_trace_args, fail, parse_early_stop, parse_options,
                       trace_sets, write_results)
from ..replay.bench import CpuTimed
from ..replay.projection import add_table_args, load_tables
from ..replay.drafters import make_drafter
from ..replay.engine import replay
from ..replay.projection import run_ms
from ..traces import Problem, TraceError, load_problems, load_tokenizer, max_len
from .admission import WaveAdmission, forecast_models, in_flight_admission
from .forecast import PathTexts
from .vote_traces import answer_extractor, load_vote_traces, path_planner, winner

DEFAULT_TRACES = ("gsm8k_qwen3_4b_n8.jsonl", "addsub_codex002_n40.jsonl")
METHODS = ("none", "consensus")


def paired_sets(path: str, tokenizer, limit: int | None, skip_bad: bool = False):
    """(problems, class ids per path, gold-correct per class or None, n): the
    problems of one trace file that have exactly the set's usual N
    completions (others are reported and left out)."""
    problems = load_problems(path, tokenizer, limit=limit, skip_bad=skip_bad)
    quiet = lambda message: None  # noqa: E731  (the same lines: load_problems reported them)
    votes = {v.id: v for v in load_vote_traces(path, tokenizer, limit, skip_bad, log=quiet)}
    counts = Counter(len(p.completions) for p in problems)
    n = max(counts, key=counts.get)
    kept = [p for p in problems if len(p.completions) == n and p.id in votes]
    if len(kept) < len(problems):
        print(f"{os.path.basename(path)}: left out {len(problems) - len(kept)} problems without "
              f"exactly {n} completions", file=sys.stderr)
    return kept, [votes[p.id] for p in kept], [votes[p.id].correct for p in kept], n


def shuffled(problems: list[Problem], ids, order: int):
    """Path order ``order`` (0: as recorded; else a seeded shuffle per
    problem): the problems, their class ids and each path's recorded number."""
    rng = random.Random(order)
    out_p, out_i, out_k = [], [], []
    for prob, cls in zip(problems, ids):
        idx = list(range(len(cls)))
        if order:
            rng.shuffle(idx)
        out_p.append(replace(prob, completions=[prob.completions[i] for i in idx]) if order else prob)
        out_i.append([cls[i] for i in idx])
        out_k.append(idx)
    return out_p, out_i, out_k


def run_one(problems, ids, correct, n, method, schedule, rule, args, options, forecast=None):
    """One replay; returns a result row (projection added by the caller).
    ``forecast``: (recorded path numbers, vote traces, texts, model) to
    vote on running paths too (a ``bayes`` rule only; the experiment of
    :mod:`evals.adaptive.forecast_model`)."""
    planner = path_planner(len(problems), n, schedule, rule)
    drafter = CpuTimed(make_drafter(method, args.k, max_len(problems, args.k), args.rows, options))
    check = None
    if forecast is not None:
        admission, check = in_flight_admission(planner, rule, problems, ids, *forecast, args.stride)
    else:
        admission = WaveAdmission(planner, ids)
    t0 = time.perf_counter()
    stats = replay(problems, drafter, method, args.k, args.rows, admission=admission)
    wall = time.perf_counter() - t0
    used = agree = right = 0
    tokens = stats.aborted_tokens
    for p, prob in enumerate(problems):
        done = sorted(planner.problems[p].paths)  # finished paths; aborted ones are not voted
        used += len(done)
        tokens += sum(len(prob.completions[k]) for k in done)
        got = winner([ids[p][k] for k in done])
        agree += got == winner(ids[p])
        right += bool(correct[p] is not None and got is not None and correct[p][got])
    steps = sum(1 for b in stats.step_rows if b)
    total_tokens = sum(len(c) for prob in problems for c in prob.completions)
    drafter_ms = [us * b / 1000.0 for us, b in zip(drafter.per_call, stats.step_rows)] \
        if method != "none" else None
    return {
        "method": method, "waves": schedule.describe(),
        "early_stop": (rule.describe() if rule else "off") + ("+forecast" if forecast else "") + (
            f" (oracle at {forecast[3].at:g})" if hasattr(forecast and forecast[3], "at") else ""),
        "forecast_checks": check.checks if check else None, "forecast_reads": check.reads if check else None,
        "problems": len(problems), "n": n, "paths_per_problem": used / len(problems),
        "aborted_tokens": stats.aborted_tokens,
        "tokens": tokens, "tokens_share": tokens / total_tokens, "agreement": agree / len(problems),
        "gold_maj": right / len(problems) if any(c is not None for c in correct) else None,
        "steps": steps, "row_steps": sum(stats.step_rows), "drafted": stats.drafted,
        "batch_fill": sum(stats.step_rows) / max(steps, 1) / args.rows,
        "schedule": schedule.describe(), "tau": stats.tau, "drafts_per_step": stats.drafts_per_step,
        "cpu_us_per_row": drafter.us_per_row, "replay_wall_s": wall,
        "_steps": (stats.step_rows, stats.step_drafted, drafter_ms),
    }


def project(row: dict, costs, host) -> None:
    rows, drafted, drafter_ms = row.pop("_steps")
    row["projected_s"] = run_ms(costs, rows, drafted, drafter_ms) / 1000.0
    if host is not None:
        row["projected_async_s"] = run_ms(costs, rows, drafted, drafter_ms, host,
                                          hide_host=drafter_ms is None) / 1000.0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m evals waves", description=__doc__.split("\n\n")[0])
    add_trace_args(ap, "gsm8k and addsub")
    ap.add_argument("--rows", type=int, default=64, help="paths in flight at most (max_num_seqs)")
    ap.add_argument("--waves", help="wave sizes, e.g. 4 or 1,2,4,rest (default: Schedule's default)")
    ap.add_argument("--early-stop", nargs="+", default=["on"],
                    help="stop rules, list ok: on (the default rule), decided, predictive:0.05, "
                         "beta:error=0.05,min_samples=2, window:4, margin:3, adaptive, esc, consol")
    ap.add_argument("--fill", choices=("on", "off", "both"), default="on",
                    help="Schedule.fill_idle: idle rows start later waves early at the tail")
    ap.add_argument("--orders", type=int, default=3, help="path orders: recorded + seeded shuffles")
    ap.add_argument("--forecast", choices=("off", "on", "both"), default="off",
                    help="bayes rules also vote on running paths' forecasts (an experiment: "
                         "evals/adaptive/forecast_model.py; 'both': with and without)")
    ap.add_argument("--forecast-model", default="others",
                    help="others (a shared set's model fitted on the other shared sets; the saved "
                         "model for other sets), saved (evals/adaptive/forecast.json), a model JSON "
                         "(python -m evals forecast --write), or oracle:AT (a ceiling: each running "
                         "path's own answer, known AT of its way through)")
    ap.add_argument("--stride", type=int, default=8, help="steps between votes on running paths")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    add_table_args(ap)
    add_option_arg(ap)
    ap.add_argument("--out", default="results/waves", help="output prefix (.json, .md and .png)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if args.rows < 1 or args.orders < 1 or args.k < 1 or args.stride < 1 \
            or (args.limit is not None and args.limit < 1):
        ap.error("--rows, --orders, --k, --stride and --limit must be >= 1")
    from consensus_spec.sampling.waves import Schedule
    try:
        fills = {"on": (True,), "off": (False,), "both": (True, False)}[args.fill]
        waves = args.waves or Schedule().describe()
        args.schedules = [Schedule.parse(waves, capacity=args.rows, fill_idle=f) for f in fills]
        args.rules = [r for r in parse_early_stop(args.early_stop) if r is not None]
        if not args.rules:
            raise ValueError("--early-stop: give at least one rule (plain runs are always included)")
    except (ValueError, UsageError) as e:
        ap.error(str(e))
    return args


def configs(args):
    """(schedule, rule, method, forecast) per replay of an order (a forecast
    for ``bayes`` rules only)."""
    from consensus_spec.sampling.waves import Schedule
    plain = Schedule(waves=("rest",), capacity=args.rows)
    ways = {"off": (False,), "on": (True,), "both": (False, True)}[args.forecast]
    rules = dict.fromkeys((r, f and r.kind == "bayes") for r in args.rules for f in ways)
    return [(plain, None, m, False) for m in METHODS] + \
        [(schedule, rule, m, f) for schedule in args.schedules for rule, f in rules for m in METHODS]


def run(args) -> tuple[list[dict], object]:
    """Result rows, and the host-time table they were projected with (None: none)."""
    tokenizer = load_tokenizer(args.tokenizer)
    costs, host = load_tables(args)
    if costs is None:
        raise FileNotFoundError(f"step-cost table not found: {args.costs}")
    options = parse_options(args.option)
    out = []
    wanted = args.forecast != "off"
    model_for = None
    sets = trace_sets(args.traces, DEFAULT_TRACES)
    if wanted:
        model_for = forecast_models(args, tokenizer, [name for name, _ in sets])
    for name, path in sets:
        problems, votes, correct, n = paired_sets(path, tokenizer, args.limit, args.skip_bad_lines)
        ids = [v.ids for v in votes]
        texts = PathTexts(votes, tokenizer, answer_extractor(path)) if model_for else None
        plain = configs(args)[0][0]  # load compiled code before anything is timed
        run_one(problems[:1], ids[:1], correct[:1], n, "consensus", plain, None, args, options)
        for order in range(args.orders):
            probs, order_ids, recorded = shuffled(problems, ids, order)
            for schedule, rule, method, forecast in configs(args):
                fc = (recorded, votes, texts, model_for(name)) if forecast else None
                row = run_one(probs, order_ids, correct, n, method, schedule, rule, args, options, fc)
                row.update(traces=name, order=order, rows=args.rows)
                project(row, costs, host)
                print(f"  {row['traces']} order {order} {method} waves={row['waves']} "
                      f"es={row['early_stop']}: tau {row['tau']:.2f}, tokens {row['tokens_share']:.3f}, "
                      f"{row['projected_s']:.2f} s projected", file=sys.stderr, flush=True)
                out.append(row)
    for row in out:  # speedups against the same set and order's plain run without drafting
        base = next(r for r in out if r["traces"] == row["traces"] and r["order"] == row["order"]
                    and r["method"] == "none" and r["early_stop"] == "off")
        row["speedup"] = base["projected_s"] / row["projected_s"]
        if "projected_async_s" in row:
            row["speedup_async"] = base["projected_async_s"] / row["projected_async_s"]
    return out, host


def _span(vals, fmt: str) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "–"
    mean = sum(vals) / len(vals)
    if len(vals) == 1 or max(vals) - min(vals) < 10 ** -6:
        return format(mean, fmt)
    return f"{format(mean, fmt)} ({format(min(vals), fmt)}–{format(max(vals), fmt)})"


COLUMNS = (("paths_per_problem", ".2f"), ("tokens_share", ".1%"), ("agreement", ".1%"), ("gold_maj", ".3f"),
           ("steps", ".0f"), ("batch_fill", ".2f"), ("tau", ".2f"), ("projected_s", ".1f"),
           ("speedup", ".2f"), ("speedup_async", ".2f"))  # the markdown's figures, each as mean (range)


def markdown(rows: list[dict], args, host) -> str:
    lines = [f"Projected H200 time to all answers (Qwen2.5-7B step costs, {args.rows} rows) over "
             "plain self-consistency without drafting, from replayed traces: a projection from "
             "measured GPU step costs and drafter CPU time measured here, not a GPU measurement. "
             f"Mean (min–max) over {args.orders} path order(s)."
             + (f" Async-aware: host time per step from {host.source}; no-drafting runs keep async "
                "scheduling." if host is not None else "")]
    for name in dict.fromkeys(r["traces"] for r in rows):
        group = [r for r in rows if r["traces"] == name]
        first = group[0]
        lines += ["", f"#### {name} ({first['problems']} problems, n={first['n']})", "",
                  "| schedule | drafting | paths/problem | tokens | agree w/ full-N | gold maj | steps | "
                  "batch fill | τ | projected s | speedup | speedup async-aware |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for key in dict.fromkeys((r["waves"], r["early_stop"], r["method"]) for r in group):
            rs = [r for r in group if (r["waves"], r["early_stop"], r["method"]) == key]
            cells = ["all at once" if key[0] == "all" else f"waves {key[0]}, {key[1]}", key[2]]
            cells += [_span([r.get(column) for r in rs], fmt) for column, fmt in COLUMNS]
            cells[-2] = f"**{cells[-2]}**"  # the speedup
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> bool:
    """Per trace set: projected speedup against agreement with the full-N
    vote, one colour per schedule x rule, circles without drafting and
    squares with consensus drafting (mean over path orders, bars down to the
    worst order)."""
    from ..plots import load_pyplot, save_figure

    _, plt = load_pyplot()
    if plt is None:
        return False
    names = list(dict.fromkeys(r["traces"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(6.2 * len(names), 4.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        group = [r for r in rows if r["traces"] == name]
        schedules = list(dict.fromkeys((r["waves"], r["early_stop"]) for r in group))
        colors = plt.get_cmap("tab10")
        for i, (waves, rule) in enumerate(schedules):
            label = "all at once" if waves == "all" else f"waves {waves}, {rule}"
            xs, ys = [], []
            for method in METHODS:
                rs = [r for r in group if (r["waves"], r["early_stop"], r["method"]) == (waves, rule, method)]
                if not rs:
                    continue
                x = sum(r["speedup"] for r in rs) / len(rs)
                y = 100 * sum(r["agreement"] for r in rs) / len(rs)
                low = 100 * min(r["agreement"] for r in rs)
                ax.errorbar([x], [y], yerr=[[y - low], [0]], fmt="o" if method == "none" else "s",
                            color=colors(i % 10), ms=7, capsize=3,
                            label=f"{label}: {method}")
                xs.append(x)
                ys.append(y)
            ax.plot(xs, ys, "-", color=colors(i % 10), lw=0.8, alpha=0.6)
        ax.set_title(f"{name}: {group[0]['problems']} problems, n={group[0]['n']}")
        ax.set_xlabel(f"projected H200 speedup, time to all answers ({group[0]['rows']} rows)")
        ax.set_ylabel("% problems agreeing with the full-N vote")
        ax.axvline(1.0, color="gray", lw=0.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5)
    return save_figure(plt, fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        rows, host = run(args)
    except (TraceError, FileNotFoundError, ValueError) as e:
        return fail(e)
    table = markdown(rows, args, host)
    print(table)
    saved = {k: v for k, v in vars(args).items() if k not in ("schedules", "rules")}
    write_results(args.out, {"args": saved, "results": rows}, table)
    if not args.no_plot and plot(rows, args.out + ".png"):
        print(f"wrote {args.out}.png")
    return 0
