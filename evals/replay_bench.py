"""Replay benchmark: every drafter on every trace set, in one run.

    python -m evals replay [--traces FILE ...] [--k 8] [--scouts 0 1] [--limit N]

Prints a markdown table and writes it with a JSON file of all figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tqdm import tqdm

from .drafters import METHODS, make_drafter
from .projection import StepCosts
from .replay import replay
from .traces import TraceError, load_problems, load_tokenizer, shared_path

DEFAULT_TRACES = ("addsub_codex002_n40.jsonl", "gsm8k_qwen3_4b_n8.jsonl", "svamp_pot_codex002_n30.jsonl")
PROJECTED_BATCHES = (16, 64, 128)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m evals replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", help="trace files (default: the shared traces)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--scouts", type=int, nargs="+", default=[0, 1], help="scout counts to run")
    ap.add_argument("--batches", type=int, nargs="+", default=list(PROJECTED_BATCHES),
                    help="batch sizes (rows) to replay at; each is projected at its own size")
    ap.add_argument("--limit", type=int, help="first N problems of each set")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: shared GPT-2)")
    ap.add_argument("--costs", default=shared_path("costs", "h200_qwen2.5-7b_step_ms.jsonl"))
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="consensus drafter option, e.g. min_prob=0.3 (repeatable)")
    ap.add_argument("--out", default="results/replay", help="output prefix (.json and .md)")
    args = ap.parse_args(argv)
    if args.k < 1 or min(args.batches) < 1 or any(s < 0 for s in args.scouts):
        ap.error("--k and --batches must be >= 1 and --scouts >= 0")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    return args


def parse_options(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--option expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value  # a bare string such as cost_model=off
    return out


def run(args) -> list[dict]:
    tokenizer = load_tokenizer(args.tokenizer)
    costs = StepCosts.load(args.costs) if args.costs and os.path.exists(args.costs) else None
    options = parse_options(args.option)
    results = []
    warmed: set[str] = set()
    for path in args.traces or [shared_path("traces", t) for t in DEFAULT_TRACES]:
        problems = load_problems(path, tokenizer, limit=args.limit)
        max_len = max(len(p.prompt) + max(map(len, p.completions)) for p in problems) + args.k + 2
        n_paths = sum(len(p.completions) for p in problems)
        name = os.path.basename(path).removesuffix(".jsonl")
        for batch in args.batches:
            for scouts in args.scouts:
                for method in args.methods:
                    if scouts and method == "none":
                        continue  # scouts change nothing without drafting
                    if method not in warmed:  # load compiled code before anything is timed
                        replay(problems[:1], make_drafter(method, args.k, max_len, batch, options),
                               method, args.k, batch, scouts)
                        warmed.add(method)
                    drafter = make_drafter(method, args.k, max_len, batch, options)
                    desc = f"{name} B={batch} {method} S={scouts}"
                    with tqdm(total=n_paths, desc=desc, leave=False) as bar:
                        stats = replay(problems, drafter, method, args.k, batch, scouts, bar)
                    row = {"traces": name, "problems": len(problems), "batch": batch, **stats.summary()}
                    if costs is not None and batch in costs.batch_sizes:
                        row["projected_speedup"] = costs.speedup(
                            batch, stats.tau, stats.drafts_per_step, stats.us_per_row)
                    results.append(row)
    return results


def markdown(results: list[dict]) -> str:
    lines = ["| traces | batch | method | scouts | tau | accept | drafts/step | drafter µs/row-step "
             "median (mean) | projected H200 speedup |", "|" + "---|" * 9]
    for r in results:
        proj = r.get("projected_speedup")
        lines.append(
            f"| {r['traces']} | {r['batch']} | {r['method']} | {r['scouts']} | {r['tau']:.2f} | "
            f"{r['acceptance']:.2f} | {r['drafts_per_step']:.2f} | "
            f"{r['median_us_per_row']:.1f} ({r['us_per_row']:.1f}) | "
            + (f"{proj:.2f}" if proj is not None else "-") + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        results = run(args)
    except (TraceError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"error: {e}. The ngram/suffix baselines need vLLM (and arctic-inference for suffix); "
              "install with `pip install -e .[cpu,bench]` or pass --methods consensus none.", file=sys.stderr)
        return 2
    table = markdown(results)
    print(table)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(table + "\n")
    print(f"wrote {args.out}.json and {args.out}.md")
    return 0
