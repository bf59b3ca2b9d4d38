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
    ap.add_argument("--max-rows", type=int, default=64, help="batch rows in the replay")
    ap.add_argument("--limit", type=int, help="first N problems of each set")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: shared GPT-2)")
    ap.add_argument("--costs", default=shared_path("costs", "h200_qwen2.5-7b_step_ms.jsonl"))
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="consensus drafter option, e.g. min_prob=0.3 (repeatable)")
    ap.add_argument("--out", default="results/replay", help="output prefix (.json and .md)")
    args = ap.parse_args(argv)
    if args.k < 1 or args.max_rows < 1 or any(s < 0 for s in args.scouts):
        ap.error("--k and --max-rows must be >= 1 and --scouts >= 0")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    return args


def parse_options(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--option expects KEY=VALUE, got {pair!r}")
        out[key] = json.loads(value) if value not in ("", None) else value
    return out


def run(args) -> list[dict]:
    tokenizer = load_tokenizer(args.tokenizer)
    costs = StepCosts.load(args.costs) if args.costs and os.path.exists(args.costs) else None
    options = parse_options(args.option)
    results = []
    for path in args.traces or [shared_path("traces", t) for t in DEFAULT_TRACES]:
        problems = load_problems(path, tokenizer, limit=args.limit)
        max_len = max(len(p.prompt) + max(map(len, p.completions)) for p in problems) + args.k + 2
        n_paths = sum(len(p.completions) for p in problems)
        name = os.path.basename(path).removesuffix(".jsonl")
        for scouts in args.scouts:
            for method in args.methods:
                if scouts and method == "none":
                    continue  # scouts change nothing without drafting
                drafter = make_drafter(method, args.k, max_len, args.max_rows, options)
                with tqdm(total=n_paths, desc=f"{name} {method} S={scouts}", leave=False) as bar:
                    stats = replay(problems, drafter, method, args.k, args.max_rows, scouts, bar)
                row = {"traces": name, "problems": len(problems), **stats.summary()}
                if costs is not None:
                    row["projected_speedup"] = {
                        b: costs.speedup(b, stats.tau, stats.drafts_per_step, stats.us_per_row)
                        for b in PROJECTED_BATCHES}
                results.append(row)
    return results


def markdown(results: list[dict]) -> str:
    head = ("| traces | method | scouts | tau | accept | drafts/step | drafter µs/row-step | "
            + " | ".join(f"projected H200 ×, B={b}" for b in PROJECTED_BATCHES) + " |")
    lines = [head, "|" + "---|" * (7 + len(PROJECTED_BATCHES))]
    for r in results:
        proj = r.get("projected_speedup") or {}
        lines.append(
            f"| {r['traces']} | {r['method']} | {r['scouts']} | {r['tau']:.2f} | {r['acceptance']:.2f} | "
            f"{r['drafts_per_step']:.2f} | {r['us_per_row']:.1f} | "
            + " | ".join(f"{proj[b]:.2f}" if b in proj else "-" for b in PROJECTED_BATCHES) + " |")
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
