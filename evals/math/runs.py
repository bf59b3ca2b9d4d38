"""Running the math eval: one engine per method (or per config), every
(n, wave schedule, stop rule) config through
:func:`consensus_spec.sampling.self_consistency`, one result row each.

Each engine is built, run and shut down in a fresh process of its own
(:func:`isolated`): engines built one after another in one process got
slower each time (3-9% by the third on this CPU, the same method run
three times), which favoured whichever method ran first."""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from ..options import write_json
from . import report
from .configs import early_stop_label
from .llm import build_llm, engine_config, proposer_counters, shutdown
from .servers import end_with_parent


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
                           engine_config(method, args)["speculative_config"], style)
            # with the engine in this process, CPU time is a load-robust companion to wall time
            in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
            row["cpu_time_s"] = time.process_time() - cpu0 if in_process else None
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


def isolated(fn, *args):
    """``fn(*args)`` in a fresh process (spawned: nothing of this one's
    engines, threads or heap carries over); its result, or its exception.
    The process ends with this one, however this one ends."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                             initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        return pool.submit(fn, *args).result()


def die_with_parent(parent: int) -> None:
    """In a worker: be killed when ``parent``, the process that spawned it,
    ends (:func:`~evals.math.servers.end_with_parent`); the parent must
    spawn the worker from a thread that outlives it, as :func:`isolated`'s
    caller, waiting on it, does."""
    if not end_with_parent(signal.SIGKILL, parent) and sys.platform.startswith("linux"):
        print(f"evals: worker {os.getpid()} cannot ask to end with its parent", file=sys.stderr,
              flush=True)


def run_all(args, problems, max_tokens: int) -> list[dict]:
    """Every method x config, ``args.repeats`` times.  By default each config
    gets a fresh engine: the suffix and consensus drafters remember earlier
    outputs per prompt and vLLM caches prompt prefixes, so a second pass over
    the same problems in one engine would be measured with an unfair head
    start.  Each repeat runs the methods in the reverse of the order before
    it (A B, B A, A B, ...): on a machine whose speed drifts while it runs
    (a shared one), each method then meets the drift alike, and the rows say
    which ``repeat`` they belong to."""
    rows: list[dict] = []
    for repeat in range(getattr(args, "repeats", 1)):
        for method in args.methods if repeat % 2 == 0 else args.methods[::-1]:
            for configs in [args.configs] if args.reuse_engine else [[c] for c in args.configs]:
                done = isolated(run_configs, method, configs, args, problems, max_tokens)
                rows += [{**row, "repeat": repeat} for row in done]
                # rows so far, for long runs (math.main removes the file once all is written)
                write_json(args.out + ".partial.json", {"results": report.public(rows)},
                           indent=None, default=str)
    return rows


def make_row(method, n, schedule, rule, run, problems, startup, spec, style) -> dict:
    stats = run.spec_decode
    tokens = run.num_tokens
    wall = run.wall_time_s
    acc = report.score(run, problems)
    return dict(
        method=method, n=n, waves=schedule.describe(), early_stop=early_stop_label(rule),
        wave_sizes=schedule.sizes(n), check=schedule.check, _stop_rule=rule,
        stop_rule=None if rule is None else dataclasses.asdict(rule),
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
