"""RL rollouts: a fixed batch of P prompts x G samples, run to its last token.

docs/rollouts.md gives the command and says how the batch is submitted, what
each method runs with, how the runs are ordered and what is reported.
Figures are medians over runs (every run in the JSON), ratios against
``none`` median over median.  The engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0 unless set otherwise), so its CPU time is
this process's.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

from ..options import UsageError, add_option_arg, fail, parse_options, write_results

METHODS = ("none", "consensus", "suffix", "ngram")


def build_parser() -> argparse.ArgumentParser:
    from ..math.llm import add_engine_args

    ap = argparse.ArgumentParser(prog="python -m evals rollout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: the embedded model)")
    ap.add_argument("--dataset", default="synthetic", help="synthetic, gsm8k, math500, ... or a file")
    ap.add_argument("--prompts", type=int, default=16, help="P: prompts in the batch")
    ap.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    ap.add_argument("--requests", action="store_true",
                    help="G separate requests per prompt instead of one request with n=G")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--runs", type=int, default=1, help="runs per method, in alternating order")
    ap.add_argument("--k", type=int, default=8, help="consensus num_speculative_tokens")
    add_option_arg(ap, "consensus drafter option (repeatable)")
    ap.add_argument("--suffix-k", type=int, help="suffix num_speculative_tokens (default: vLLM's)")
    ap.add_argument("--ngram-k", type=int, default=5, help="ngram num_speculative_tokens")
    ap.add_argument("--ngram-lookup", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"))
    add_engine_args(ap)
    ap.add_argument("--out", default="results/rollout", help="output prefix (.json, .md)")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if min(args.prompts, args.group, args.max_tokens, args.runs, args.k, args.ngram_k) < 1:
        ap.error("--prompts, --group, --max-tokens, --runs, --k and --ngram-k must be >= 1")
    if not 1 <= args.ngram_lookup[0] <= args.ngram_lookup[1]:
        ap.error("--ngram-lookup needs 1 <= MIN <= MAX")
    args.methods = list(dict.fromkeys(args.methods))
    try:
        args.drafter_options = parse_options(args.option)
    except ValueError as e:
        ap.error(str(e))
    if args.max_num_seqs is None:
        args.max_num_seqs = args.prompts * args.group
    return args


def submit(llm, prompts: list[str], args, max_tokens: int):
    """One rollout batch through ``LLM.generate``: (outputs, steps, wall s, CPU s)."""
    from vllm import SamplingParams

    from .timeline import StepRecorder

    n = 1 if args.requests else args.group
    batch = [p for p in prompts for _ in range(args.group)] if args.requests else prompts
    params = SamplingParams(n=n, temperature=args.temperature, top_p=args.top_p, max_tokens=max_tokens)
    cpu0, t0 = time.process_time(), time.perf_counter()
    with StepRecorder(llm) as rec:
        outputs = llm.generate(batch, params, use_tqdm=False)
    return outputs, rec.steps, time.perf_counter() - t0, time.process_time() - cpu0


def run_one(method: str, args, prompts: list[str], warm: list[str], run: int) -> dict:
    from ..math.llm import build_llm, engine_config, proposer_counters, shutdown
    from .timeline import summarize

    t0 = time.perf_counter()
    llm = build_llm(method, args, log_stats=False)
    startup = time.perf_counter() - t0
    try:
        # warm-up at the batch's shape on other prompts (drafters must not see these), not timed
        submit(llm, warm, args, 16)
        outputs, steps, wall, cpu = submit(llm, prompts, args, args.max_tokens)
        counters = proposer_counters(llm) if method == "consensus" else None
    finally:
        shutdown(llm)
        del llm
        gc.collect()
    lengths = [len(c.token_ids) for o in outputs for c in o.outputs]
    row = {"method": method, "run": run, "startup_s": startup, "cpu_s": cpu, **summarize(steps, wall),
           "rows": len(lengths), "output_tokens": sum(lengths), "shortest": min(lengths),
           "longest": max(lengths), "rows_at_max_tokens": sum(n >= args.max_tokens for n in lengths),
           "speculative_config": engine_config(method, args)["speculative_config"]}
    if counters:
        row["proposer"] = {k: v for k, v in counters.items()
                           if k in ("num_drafted", "num_accepted", "step_costs_by_rows", "steps_timed",
                                    "explore_pct", "cost_model", "error")}
    print(f"  run {run + 1} {method}: makespan {wall:.2f} s (CPU {cpu:.1f} s), tail {row['tail_s']:.2f} s, "
          f"{row['tokens']} tokens", file=sys.stderr, flush=True)
    return row


def median(rows: list[dict], key: str):
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def markdown(rows: list[dict], args) -> str:
    def f(x, spec=".2f"):
        return "–" if x is None else format(x, spec)

    by = {m: [r for r in rows if r["method"] == m] for m in args.methods}
    base = by.get("none") or []
    mk0, tail0 = median(base, "makespan_s"), median(base, "tail_s")
    lines = [f"Rollout batch: {args.prompts} prompts x {args.group} samples "
             f"({'separate requests' if args.requests else 'n=G'}), T {args.temperature}, "
             f"max_tokens {args.max_tokens}, {args.runs} run(s) per method in alternating order; "
             "medians, measured on this machine.", "",
             "| method | makespan s (runs) | × none | tail s | × none | tokens/s | CPU s | "
             "tok/row-step before drain | after drain | rows after drain (mean) | tokens | rows at max |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, rs in by.items():
        if not rs:
            continue
        mk, tail = median(rs, "makespan_s"), median(rs, "tail_s")
        runs = " / ".join(f"{r['makespan_s']:.1f}" for r in rs)
        lines.append(
            f"| {m} | {mk:.2f} ({runs}) | {f(mk0 / mk if mk0 and mk else None)}× | {f(tail)} | "
            f"{f(tail0 / tail if tail0 and tail else None)}× | {f(median(rs, 'tokens_per_s'), '.0f')} | "
            f"{f(median(rs, 'cpu_s'), '.1f')} | {f(median(rs, 'tau_before_drain'))} | "
            f"{f(median(rs, 'tau_after_drain'))} | {f(median(rs, 'mean_rows_after_drain'), '.1f')} | "
            f"{f(median(rs, 'tokens'), '.0f')} | {f(median(rs, 'rows_at_max_tokens'), '.0f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # CPU time: the engine in this process
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from ..math.datasets import DatasetError, load_problems
    from ..math.llm import resolve_model
    from ..math.prompts import build_prompt

    try:
        args.model = resolve_model(args.model)
        problems = load_problems(args.dataset, limit=2 * args.prompts)
    except (UsageError, DatasetError) as e:
        return fail(e)
    if len(problems) < 2 * args.prompts:  # the second P warm each engine up
        return fail(f"{args.dataset} has {len(problems)} problems, the run needs 2 x --prompts")
    tokenizer = None
    if any(p.kind != "synthetic" for p in problems):
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [build_prompt(p, tokenizer) for p in problems[:args.prompts]]
    warm = [build_prompt(p, tokenizer) for p in problems[args.prompts:]]
    rows = []
    for run in range(args.runs):
        order = args.methods if run % 2 == 0 else args.methods[::-1]
        for method in order:
            rows.append(run_one(method, args, prompts, warm, run))
    table = markdown(rows, args)
    print(table)
    payload = {"args": {k: v for k, v in vars(args).items()}, "prompt_example": prompts[0], "results": rows}
    write_results(args.out, payload, table)
    return 0
