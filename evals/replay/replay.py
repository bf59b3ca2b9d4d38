"""Replay benchmark: every drafter on every trace set, in one run.

    python -m evals replay [--traces FILE ...] [--batches 16 64 128] [--k 8]
                           [--schedules sweep|fixed] [--tune-limit 100]
                           [--host-time results/host_time.jsonl] [--repeats 2]
    python -m evals replay --from-json results/replay.json --host-time OTHER.jsonl

The methods are ``evals/replay/drafters.py``'s. ngram and suffix run under the
best ``num_speculative_tokens_per_batch_size`` schedule a sweep over k finds
(``--schedules sweep``: per trace set, on its first ``--tune-limit``
problems, k in ``--sweep-k`` at each batch size; then every method runs on
the whole set) or at k everywhere (``fixed``).  Each figure is a projected
H200 decode speedup over no drafting, async-unaware and async-aware
(``evals/replay/projection.py``), from the measured step-cost table, τ and
drafts per row-step from the replay and the drafter's CPU time measured
here: a projection, not a GPU measurement.

Prints one markdown table per trace set and writes them, the sweep and every
figure to ``--out``.md/.json.
"""

from __future__ import annotations

import argparse
import json

from ..machine import loop_line, python_loop_ns
from ..options import add_option_arg, add_trace_args, fail, trace_sets, write_results
from ..traces import TraceError, load_problems, load_tokenizer
from .bench import Bench, pick_schedule
from .projection import add_table_args, load_tables, pair_runs
from .drafters import DEVICE_METHODS, METHODS, SCHEDULABLE
from .report import fixed_markdown, markdown, sweep_markdown, targets

DEFAULT_TRACES = ("addsub_codex002_n40.jsonl", "gsm8k_qwen3_4b_n8.jsonl", "svamp_pot_codex002_n30.jsonl")
PROJECTED_BATCHES = (16, 64, 128)
SWEEP_K = (0, 1, 2, 3, 4, 6, 8)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m evals replay", description=__doc__.split("\n\n")[0])
    add_trace_args(ap)
    ap.add_argument("--methods", nargs="+",
                    default=[m for m in METHODS if m not in DEVICE_METHODS and m != "consensus-truth"],
                    choices=METHODS, help="default: all but the device-route emulations (device-lag*)")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens (the most any step drafts)")
    ap.add_argument("--scouts", type=int, nargs="+", default=[0], help="scout counts to run")
    ap.add_argument("--batches", type=int, nargs="+", default=list(PROJECTED_BATCHES),
                    help="batch sizes (rows) to replay at; each is projected at its own size")
    add_table_args(ap)
    ap.add_argument("--schedules", choices=("sweep", "fixed"), default="sweep",
                    help="ngram/suffix k per batch size: the best of a sweep, or --k everywhere")
    ap.add_argument("--schedule", nargs="+", metavar="LO-HI:K",
                    help="one num_speculative_tokens_per_batch_size schedule for every method "
                         "(vLLM applies it to ngram, suffix and device-lag*); no sweep")
    ap.add_argument("--step-log", action="store_true",
                    help="each result also lists its drafter calls ([rows, [draft lengths]]) and "
                         "steps ([rows, tokens drafted])")
    ap.add_argument("--sweep-k", type=int, nargs="+", default=list(SWEEP_K), help="k values swept")
    ap.add_argument("--tune-limit", type=int, default=100, help="problems of each set the sweep runs on")
    ap.add_argument("--suffix-min-prob", type=float, nargs="+", default=[0.1],
                    help="suffix_decoding_min_token_prob values swept (engine-wide, with the schedule)")
    ap.add_argument("--suffix-spec-factor", type=float, nargs="+", default=[1.0],
                    help="suffix_decoding_max_spec_factor values swept (engine-wide, with the schedule)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of the consensus methods at --repeat-batches (spread of drafter time)")
    ap.add_argument("--repeat-batches", type=int, nargs="+", default=[128])
    add_option_arg(ap)
    ap.add_argument("--admission", choices=("refill", "fixed"), default="refill",
                    help="refill: a path enters as soon as a row is free (default); fixed: RL rollout "
                         "batches of --batches rows, admitted whole, run to the last token, no refill "
                         "(docs/rollouts.md)")
    ap.add_argument("--group", type=int, help="with --admission fixed: paths per problem (default: all)")
    ap.add_argument("--out", default="results/replay", help="output prefix (.json and .md)")
    ap.add_argument("--drafter-time-scale", type=float, default=1.0,
                    help="what-if: project with the measured drafter time times this (e.g. 0.5 for a "
                         "host CPU twice as fast as this one during the run)")
    ap.add_argument("--costs-slope-scale", type=float, default=1.0,
                    help="what-if truth: the --costs table with each step's cost above one token "
                         "per row times this (drives the replay's clock and the projection)")
    ap.add_argument("--prior-scale", type=float, default=1.0,
                    help="what-if prior: consensus starts from the H200 model with its compute "
                         "cost per token times this (a prior this far off; the truth unchanged)")
    ap.add_argument("--online", choices=("on", "off"), default="on",
                    help="consensus learns its step costs from a clock that the --costs table "
                         "drives (the prior is its cost_model option); off: fixed cost model")
    ap.add_argument("--startup-profile", type=float, metavar="NOISE",
                    help="consensus starts each run from an emulated start-up profile: the --costs "
                         "table timed with relative noise NOISE (evals/replay/projection.py)")
    ap.add_argument("--profile-seed", type=int, default=0, help="seed of the profile's noise")
    ap.add_argument("--save-costs", metavar="DIR",
                    help="keep each consensus run's remembered step costs as DIR/SET_B<rows>.json")
    ap.add_argument("--costs-from", metavar="DIR",
                    help="each consensus run starts from DIR/SET_B<rows>.json (a --save-costs run's)")
    ap.add_argument("--from-json", metavar="FILE",
                    help="replay nothing: project the results of an earlier run's .json afresh "
                         "(e.g. on another --host-time or --costs table)")
    ap.add_argument("--repick", action="store_true",
                    help="with --from-json: pick each set's schedules afresh from its saved sweep as "
                         "projected here (what the sweep would choose on these tables; the results "
                         "keep the schedules they ran with)")
    args = ap.parse_args(argv)
    try:
        args.schedule = parse_schedule(args.schedule)
    except ValueError as e:
        ap.error(str(e))
    if args.k < 1 or min(args.batches) < 1 or any(s < 0 for s in args.scouts):
        ap.error("--k and --batches must be >= 1 and --scouts >= 0")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    if args.tune_limit < 1 or args.repeats < 1:
        ap.error("--tune-limit and --repeats must be >= 1")
    if args.drafter_time_scale < 0 or args.costs_slope_scale < 0 or args.prior_scale <= 0:
        ap.error("--drafter-time-scale and --costs-slope-scale must be >= 0, --prior-scale > 0")
    if args.admission == "fixed" and args.from_json:
        ap.error("--admission fixed replays: it has no --from-json")
    if args.group is not None and args.group < 1:
        ap.error("--group must be >= 1")
    if args.startup_profile is not None and not 0.0 <= args.startup_profile < 0.5:
        ap.error("--startup-profile NOISE must be in [0, 0.5)")
    if (args.startup_profile is not None or args.save_costs or args.costs_from) and args.online == "off":
        ap.error("--startup-profile, --save-costs and --costs-from need --online on")
    if args.repick and not args.from_json:
        ap.error("--repick needs --from-json")
    if min(args.sweep_k) < 0 or max(args.sweep_k) > args.k:
        ap.error(f"--sweep-k values must be in 0..--k ({args.k})")
    return args


def parse_schedule(entries) -> list[tuple[int, int, int]] | None:
    """``LO-HI:K`` entries as vLLM's ``[(lo, hi, k), ...]``."""
    if entries is None:
        return None
    out = []
    for e in entries:
        try:
            span, k = e.split(":")
            lo, hi = span.split("-")
            out.append((int(lo), int(hi), int(k)))
        except ValueError:
            raise ValueError(f"--schedule expects LO-HI:K entries, got {e!r}") from None
    return out


def reproject(args) -> tuple[list[dict], list[dict], dict]:
    """Results of an earlier run (``--from-json``), projected afresh on this
    run's ``--costs`` and ``--host-time``: nothing is replayed."""
    with open(args.from_json, encoding="utf-8") as f:
        saved = json.load(f)
    bench = Bench(args, *load_tables(args))
    # the whole-run projection needs each step, which is not saved: left out here
    strip = ("speedup", "speedup_async", "speedup_both_sync", "host_ms", "break_even_host_ms",
             "run_ms", "run_speedup")
    results = [bench.project({k: v for k, v in r.items() if k not in strip}) for r in saved["results"]]
    sweeps = [bench.project({k: v for k, v in r.items() if k not in strip}) for r in saved.get("sweep", [])]
    tuned = saved.get("schedules", {})  # as saved (JSON keys): only the markdown and the .json read them
    if args.repick:
        for key in dict.fromkeys((r["traces"], r["method"]) for r in sweeps):
            rows = [r for r in sweeps if (r["traces"], r["method"]) == key and "speedup" in r]
            if rows:
                tuned.setdefault(key[0], {})[key[1]] = {**pick_schedule(rows),
                                                        "tune_problems": rows[0].get("tune_problems")}
    return results, sweeps, tuned


def run(args) -> tuple[list[dict], list[dict], dict]:
    """(results, sweep rows, tuned schedules by trace set and method)."""
    tokenizer = load_tokenizer(args.tokenizer)
    costs, host = load_tables(args)
    bench = Bench(args, costs, host)
    results, sweeps, tuned = [], [], {}
    for name, path in trace_sets(args.traces, DEFAULT_TRACES):
        problems = load_problems(path, tokenizer, limit=args.limit, skip_bad=args.skip_bad_lines)
        tuned[name] = {}
        if args.schedules == "sweep" and costs is not None and args.schedule is None:
            tune = problems[:args.tune_limit]
            for method in (m for m in SCHEDULABLE if m in args.methods):
                rows = bench.sweep(tune, name, method)
                for r in rows:
                    r["tune_problems"] = len(tune)
                sweeps.extend(rows)
                tuned[name][method] = {**pick_schedule(rows), "tune_problems": len(tune)}
        for batch in args.batches:
            for scouts in args.scouts:
                for method in args.methods:
                    if scouts and method == "none":
                        continue  # scouts change nothing without drafting
                    pick = tuned[name].get(method)
                    schedule, params = ((pick["schedule"], pick["params"] or None) if pick
                                        else (args.schedule, None))
                    if args.admission == "fixed":
                        results.append(bench.run_fixed(problems, name, method, batch, args.group,
                                                       schedule, params))
                        continue
                    repeats = (args.repeats if method.startswith("consensus")
                               and batch in args.repeat_batches else 1)
                    for i in range(repeats):
                        row = bench.run(problems, name, method, batch, scouts, schedule, params,
                                        tag=f" run {i + 1}" if repeats > 1 else "")
                        row["run"] = i
                        if pick:
                            row["k_at_batch"] = pick["k"].get(batch)
                        results.append(row)
    return pair_runs(results), sweeps, tuned


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        reference = [] if args.from_json else [python_loop_ns()]
        results, sweeps, tuned = reproject(args) if args.from_json else run(args)
        if not args.from_json:
            reference.append(python_loop_ns())
        host = load_tables(args, quiet=True)[1]
    except (TraceError, FileNotFoundError, ValueError, KeyError) as e:
        return fail(e)
    except ImportError as e:
        return fail(f"{e}. The ngram/suffix baselines need vLLM (and arctic-inference for suffix); "
                    "install with `pip install -e .[cpu,bench]` or pass --methods consensus none.")
    if args.admission == "fixed":
        table, checks = fixed_markdown(results), []
    else:
        table, checks = markdown(results, tuned, host), targets(results)
    sweep_table = sweep_markdown(sweeps)
    if args.drafter_time_scale != 1.0:
        table = (f"WHAT-IF projection: measured drafter time × {args.drafter_time_scale:g}"
                 " (not what was measured).\n\n" + table)
    if reference:
        table += "\n\n" + loop_line(*reference) + " Drafter times scale with it."
    costs = load_tables(args, quiet=True)[0]
    if costs is not None and costs.extended:
        table += (f"\n\nStep costs at {', '.join(map(str, costs.extended))} rows: this project's "
                  "H200 measurement (evals/replay/h200_large_batches.jsonl), beyond the table's own.")
    text = (table + ("\n\n" + sweep_table if sweep_table else "")
            + ("\n\nTargets:\n" + "\n".join("- " + c for c in checks) if checks else ""))
    print(text)
    write_results(args.out, {"args": vars(args), "python_loop_ns": reference, "results": results,
                             "sweep": sweeps, "schedules": tuned}, text)
    return 0
