"""Record multi-sample traces: n sampled completions per problem from any vLLM model.

    python -m evals record --out FILE.jsonl [--dataset synthetic|gsm8k|math500|aime2024|FILE]
                           [--limit N] [--n 8] [--temperature 0.8] [--max-tokens T]
                           [--fewshot K]
                           [--model DIR] [--speculative none|consensus] [--logprobs]

Plain ``LLM.generate`` with ``SamplingParams(n=...)`` on the math eval's
problems and prompts (``evals/math/datasets.py``, ``evals/math/prompts.py``; with
``--fewshot K`` each GSM8K prompt begins with K solved examples), written to
``--out`` in batches of ``--batch-size`` problems, one problem per line: the
shared trace format (``id``, ``prompt``, ``completions``, ``answer`` (gold),
``model``, ``temperature``, ``source``; see ../shared/data/README.md) plus
``prompt_ids`` (the prompt's token ids as sent), ``completion_ids`` (the
sampled ids, ending with ``meta.eos_token_id`` where a path stopped on it),
``logprobs`` (with ``--logprobs``: each sampled token's logprob),
``finish_reasons``, ``answers`` (``consensus_spec.extract_answer``, as the
math eval votes), ``gold`` and ``meta`` (model, sampling parameters, EOS id,
vLLM and consensus_spec versions).  ``evals/traces.py`` replays the ids as
recorded, without a tokenizer.

Rerun with the same ``--out`` to resume: problems already in the file are
skipped, a truncated last line (an interrupted write) is dropped with a
message, and different sampling settings are refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..options import UsageError, add_option_arg, fail
from ..traces import TraceError, TraceLines
from .configs import Parser, max_tokens
from .llm import (add_run_args, build_llm, check_dependencies, check_run_args, drafter_options, engine_env,
                  load_run, shutdown)

# meta fields that must match to append to an existing file
SAME_ON_RESUME = ("model", "dataset", "fewshot", "n", "temperature", "top_p", "max_tokens", "seed",
                  "logprobs")


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="python -m evals record", description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSONL trace file (appended to: resumes)")
    ap.add_argument("--dataset", default="synthetic",
                    help="synthetic (default), gsm8k, math500, aime2024, or a .jsonl/.json/.parquet file")
    ap.add_argument("--fewshot", type=int, metavar="K",
                    help="with --dataset gsm8k: K solved examples before each question (the first K "
                         "of ../shared/data/math/gsm8k_train.jsonl), a few-shot chain-of-thought prompt")
    add_run_args(ap)
    ap.add_argument("--n", type=int, default=8, help="samples per problem")
    ap.add_argument("--logprobs", action="store_true", help="store each sampled token's logprob")
    ap.add_argument("--speculative", choices=("none", "consensus"), default="none",
                    help="consensus drafting while recording (lossless: same distribution)")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens with --speculative consensus")
    add_option_arg(ap, "consensus option with --speculative consensus, e.g. cost_model=off "
                       "(repeatable; replay the traces with the same ones to compare tau)")
    ap.add_argument("--batch-size", type=int, default=16, help="problems per generate call and write")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    check_run_args(args, ("k", "batch_size", "limit", "fewshot"))
    if args.fewshot and args.dataset.lower() != "gsm8k":
        raise UsageError("--fewshot takes GSM8K's train split as examples: use it with --dataset gsm8k")
    # llm.build_llm reads it
    args.drafter_options = drafter_options(args, check=args.speculative == "consensus")
    if args.drafter_options and args.speculative != "consensus":
        raise UsageError("--option applies to --speculative consensus only")
    return args


def model_name(model: str | None) -> str:
    if model is None:
        return "consensus_spec-embedded"
    path = os.path.expanduser(model)
    return os.path.basename(os.path.normpath(path)) if os.path.isdir(path) else model


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import vllm
    try:
        own = version("consensus_spec")
    except PackageNotFoundError:
        own = None
    return {"vllm": getattr(vllm, "__version__", None), "consensus_spec": own}


def read_recorded(path: str, log=print) -> tuple[set[str], dict | None]:
    """Ids already in ``path`` and the first line's meta.  A last line
    without its newline that is not valid JSON (an interrupted write) is cut
    off with a message; then every line is read as any trace file is
    (:class:`~evals.traces.TraceLines`: a bad line is an error naming it)."""
    if not os.path.exists(path):
        return set(), None
    mend_tail(path, log)
    done, meta = set(), None
    try:
        for lineno, obj in TraceLines(path):
            if "id" not in obj:
                raise UsageError(f"{path}, line {lineno}: not a trace object with an id")
            done.add(str(obj["id"]))
            meta = meta or obj.get("meta")
    except TraceError as e:
        raise UsageError(f"{e}; fix or remove the line, or record to another --out") from None
    return done, meta


def mend_tail(path: str, log=print) -> None:
    """End ``path`` on a newline: a last line cut short by an interrupted
    write is dropped (its problem is recorded again), a whole one gets its
    newline."""
    with open(path, "r+b") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if not data[end:].strip():
            return
        try:
            json.loads(data[end:])
            f.write(b"\n")  # at the end: read left the file there
        except ValueError:
            lineno = data.count(b"\n") + 1
            log(f"{path}: line {lineno} is truncated (an interrupted write): dropped, its problem is "
                "recorded again")
            f.truncate(end)


def check_resume(path: str, old: dict | None, new: dict) -> None:
    if old is None:
        return
    for key in SAME_ON_RESUME:
        if old.get(key) != new.get(key):
            raise UsageError(f"{path} was recorded with {key}={old.get(key)!r}, this run has "
                             f"{new.get(key)!r}: use another --out or the same settings")


def trace_line(problem, prompt: str, output, meta: dict, logprobs: bool) -> dict:
    from consensus_spec import extract_answer

    comps = list(output.outputs)
    line = dict(id=problem.id, prompt=prompt, completions=[c.text for c in comps],
                answer=problem.gold, model=meta["model"], temperature=meta["temperature"],
                source=f"python -m evals record --dataset {meta['dataset']}"
                       + (f" --fewshot {meta['fewshot']}" if meta.get("fewshot") else ""),
                gold=problem.gold, answers=[extract_answer(c.text) for c in comps],
                prompt_ids=list(output.prompt_token_ids),
                completion_ids=[list(c.token_ids) for c in comps])
    if logprobs:
        line["logprobs"] = [[round(float(step[t].logprob), 4) for t, step in zip(c.token_ids, c.logprobs)]
                            for c in comps]
    line["finish_reasons"] = [c.finish_reason for c in comps]
    line["meta"] = meta
    return line


def record(args, problems, meta: dict, done: set[str], shots=()) -> dict:
    from tqdm import tqdm
    from vllm import SamplingParams

    from .prompts import build_prompt

    todo = [p for p in problems if p.id not in done]
    t0 = time.perf_counter()
    llm = build_llm(args.speculative, args)
    startup = time.perf_counter() - t0
    stats = dict(problems=0, samples=0, tokens=0, startup_s=round(startup, 1))
    try:
        tokenizer = llm.get_tokenizer()
        meta["eos_token_id"] = getattr(tokenizer, "eos_token_id", None)
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                                max_tokens=meta["max_tokens"], logprobs=0 if args.logprobs else None)
        from consensus_spec.sampling.engine_loop import read_spec_counters, spec_stats_delta

        before = read_spec_counters(llm)
        t1 = time.perf_counter()
        with open(args.out, "a", encoding="utf-8") as f, \
                tqdm(total=len(problems), initial=len(problems) - len(todo), desc="record",
                     unit="problem", file=sys.stderr, dynamic_ncols=True) as bar:
            for i in range(0, len(todo), args.batch_size):
                batch = todo[i:i + args.batch_size]
                prompts = [build_prompt(p, tokenizer, shots) for p in batch]
                outputs = llm.generate(prompts, params, use_tqdm=False)
                text = "".join(json.dumps(trace_line(p, q, o, meta, args.logprobs),
                                          separators=(",", ":")) + "\n"
                               for p, q, o in zip(batch, prompts, outputs))
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
                stats["problems"] += len(batch)
                stats["samples"] += sum(len(o.outputs) for o in outputs)
                stats["tokens"] += sum(len(c.token_ids) for o in outputs for c in o.outputs)
                bar.update(len(batch))
        stats["generate_s"] = round(time.perf_counter() - t1, 1)
        spec = spec_stats_delta(before, read_spec_counters(llm))
        if spec is not None and spec.num_drafts:
            # tokens per row-step as the replay counts it: every step yields
            # one token per row plus what it accepted
            stats["engine"] = {"num_drafts": spec.num_drafts, "draft_tokens": spec.num_draft_tokens,
                               "accepted": spec.num_accepted_tokens,
                               "mean_acceptance_length": round(spec.mean_acceptance_length, 3),
                               "tau": round(stats["tokens"] / max(stats["tokens"] - spec.num_accepted_tokens, 1), 3)}
    finally:
        shutdown(llm)
    return stats


def load_shots(k: int | None) -> list[tuple[str, str]]:
    """``--fewshot``'s (question, worked answer) pairs; UsageError if they
    cannot be read."""
    if not k:
        return []
    from .prompts import FewShotError, fewshot_examples
    try:
        return fewshot_examples(k)
    except FewShotError as e:
        raise UsageError(str(e)) from None


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        name = model_name(args.model)
        problems = load_run(args)
        shots = load_shots(args.fewshot)
        check_dependencies([args.speculative])
        meta = dict(model=name, dataset=args.dataset, n=args.n, temperature=args.temperature,
                    top_p=args.top_p, max_tokens=max_tokens(args, problems),
                    seed=args.seed, logprobs=args.logprobs, speculative=args.speculative,
                    speculative_options=args.drafter_options, k=args.k,
                    dtype=args.dtype, **versions())
        if args.fewshot:  # only then: files recorded before --fewshot resume as they were
            meta["fewshot"] = args.fewshot
        done, old_meta = read_recorded(args.out, log=lambda m: print(m, file=sys.stderr))
        check_resume(args.out, old_meta, meta)
    except UsageError as e:
        return fail(e)
    left = sum(p.id not in done for p in problems)
    if not left:
        print(f"{args.out}: all {len(problems)} problems already recorded")
        return 0
    if done:
        print(f"{args.out}: resuming, {len(problems) - left} of {len(problems)} problems already recorded",
              file=sys.stderr)
    engine_env(args.verbose)  # as the math eval: one process on CPU
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    stats = record(args, problems, meta, done, shots)
    rate = stats["tokens"] / stats["generate_s"] if stats.get("generate_s") else 0.0
    print(f"wrote {stats['problems']} problems ({stats['samples']} samples, {stats['tokens']} tokens, "
          f"{rate:.0f} tokens/s; engine start {stats['startup_s']} s) to {args.out}")
    if "engine" in stats:
        e = stats["engine"]
        print(f"engine drafting: {e['accepted']} of {e['draft_tokens']} draft tokens accepted, mean "
              f"acceptance length {e['mean_acceptance_length']}, tokens per row-step (tau) {e['tau']}")
    return 0
