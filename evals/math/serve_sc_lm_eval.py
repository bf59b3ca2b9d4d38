"""``python -m evals serve-sc-lm-eval``: lm-evaluation-harness's
self-consistency as users run it, and through the base URL.

``--task synthetic`` (the default): the embedded model on its held-out
problems, the task files in ``evals/lm_eval_tasks/``:

- ``repeats``: ``consensus_synthetic_sc`` (``repeats: n``, unseeded, voted
  by the task's own ``filter_list``: the answer line's number, then lm-eval's
  ``majority_vote``) through ``local-completions`` to ``/v1/completions`` on
  a plain server, every repeat its own request (``num_concurrent`` =
  concurrency x n, so as many paths run at once as below);
- ``base-url``: ``consensus_synthetic_sc_base_url``, the same task with one
  request per problem, ``n`` and the task's regex as ``answer_pattern`` in
  ``--gen_kwargs``, to ``/v1/self_consistency/completions`` on a server with
  consensus drafting (``num_concurrent`` = concurrency).

``--task gsm8k --model DIR``: GSM8K on a real model, from lm-eval's
installed YAML:

- ``repeats``: lm-eval's own ``gsm8k-cot-self-consistency`` task (8-shot
  chain of thought, ``repeats: n``, temperature 0.2, maj@n by its regex)
  through ``local-completions`` against a plain vLLM server, every repeat
  its own ``/v1/completions`` request (``num_concurrent`` = concurrency x n,
  so as many paths run at once as below).  lm-eval gives every request one
  seed, so copies of a prompt repeat each other: the distinct completions
  per problem say how many of the n votes were real.
- ``base-url``: lm-eval's plain ``gsm8k-cot`` task (the same 8 shots; its
  strict-match filter) with ``n`` and the SC task's regex as
  ``answer_pattern`` in ``--gen_kwargs``, through ``local-completions`` at
  ``/v1/self_consistency/completions`` on a server with consensus drafting
  (``num_concurrent`` = concurrency).

Both are lm-eval's installed YAML with the dataset read from
``../shared/data/math/gsm8k_test.jsonl`` (the hub is out of reach).

Runs alternate the order; per run: wall, the server's process-tree CPU,
this process's CPU (lm-eval runs in it), accuracy, distinct completions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from ..options import write_json
from .servers import PLUGINS, SERVED, VllmServer, server_args

SC_REGEX = r"The answer is (\-?[0-9\.\,]*[0-9]+)"  # gsm8k-cot-self-consistency.yaml's
SYNTHETIC_REGEX = r"The answer is (\-?[0-9]+)"  # consensus_synthetic_sc.yaml's
CONFIGS = ("repeats", "base-url")
TASK_DIR = Path(__file__).resolve().parent.parent / "lm_eval_tasks"
SYNTHETIC = "consensus_synthetic_sc"


def synthetic_tasks(out_dir: Path, n: int) -> dict[str, str]:
    """The repository's task and its base-URL twin, ``repeats`` set to ``n``
    (each file includes the repository's, so its filters and dataset stay one)."""
    import yaml

    names = {"repeats": f"{SYNTHETIC}_{n}", "base-url": f"{SYNTHETIC}_base_url"}
    for config, repeats, source in (("repeats", n, SYNTHETIC), ("base-url", 1, f"{SYNTHETIC}_base_url")):
        spec = {"include": str(TASK_DIR / f"{source}.yaml"), "task": names[config], "repeats": repeats}
        (out_dir / f"{names[config]}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return names


def task_files(out_dir: Path, data: Path, n: int) -> dict[str, str]:
    """Two local tasks from lm-eval's installed GSM8K chain-of-thought YAML."""
    import yaml
    from lm_eval import tasks as lm_tasks

    folder = Path(lm_tasks.__file__).parent / "gsm8k"
    cot = yaml.safe_load((folder / "gsm8k-cot.yaml").read_text())
    sc = yaml.safe_load((folder / "gsm8k-cot-self-consistency.yaml").read_text())
    local = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
             "test_split": "test"}
    for drop in ("dataset_name", "tag", "include"):
        cot.pop(drop, None)
        sc.pop(drop, None)
    plain = {**cot, **local, "task": "gsm8k_cot_local"}
    repeats = {**cot, **sc, **local, "task": "gsm8k_cot_sc_local", "repeats": n,
               "filter_list": [f for f in sc["filter_list"] if f["name"] == "score-first"]
               + [{"name": f"maj@{n}", "filter": [{"function": "regex", "regex_pattern": SC_REGEX},
                                                  {"function": "majority_vote"},
                                                  {"function": "take_first"}]}]}
    for spec in (plain, repeats):
        (out_dir / f"{spec['task']}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return {"base-url": plain["task"], "repeats": repeats["task"]}


def run_lm_eval(config: str, args, base_url: str, task: str, include: Path) -> dict:
    """lm-eval in this process; (accuracy, distinct completions per problem, wall)."""
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    votes: list[dict] = []
    parse = LocalCompletionsAPI.parse_generations

    def spy(outputs, **kwargs):  # the base URL's votes: how many distinct paths each had
        for out in outputs if isinstance(outputs, list) else [outputs]:
            votes.extend(c.get("self_consistency", {}) for c in out.get("choices", []))
        return parse(outputs, **kwargs)

    LocalCompletionsAPI.parse_generations = staticmethod(spy)
    try:
        route = "/v1/self_consistency/completions" if config == "base-url" else "/v1/completions"
        concurrent = args.concurrency if config == "base-url" else args.concurrency * args.n
        synthetic = args.task == "synthetic"
        gen = {"do_sample": True, "temperature": args.temperature, "max_gen_toks": args.max_tokens,
               "until": ["Question:"] if synthetic else ["Q:", "\n\n"]}
        if synthetic:
            gen["seed"] = None  # as the task file says: unseeded repeats are n samples
        if config == "base-url":
            gen.update(n=args.n, answer_pattern=SYNTHETIC_REGEX if synthetic else SC_REGEX)
        t0 = time.monotonic()
        res = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"model={SERVED},base_url={base_url}{route},tokenizer={args.model_dir},"
                       f"tokenized_requests=False,num_concurrent={concurrent},max_retries=2,"
                       f"timeout={int(args.timeout)}",
            tasks=[task], task_manager=TaskManager(include_path=str(include)), gen_kwargs=gen,
            limit=args.limit, log_samples=True, batch_size=1)
        wall = time.monotonic() - t0
    finally:
        LocalCompletionsAPI.parse_generations = staticmethod(parse)
    metrics = res["results"][task]
    if args.task == "synthetic":
        key = "exact_match,maj"
    else:
        key = f"exact_match,maj@{args.n}" if config == "repeats" else "exact_match,strict-match"
    samples = list({s["doc_id"]: s for s in res["samples"][task]}.values())  # one per filter
    if config == "repeats":  # a doc's resps: one list per instance, its repeats' texts in it
        distinct = [len(set(_texts(s["resps"]))) for s in samples]
    else:
        distinct = [v.get("distinct_texts", 0) for v in votes]
    return {"accuracy": metrics[key], "accuracy_se": metrics.get(key.replace(",", "_stderr,")),
            "problems": len(samples), "distinct": distinct, "wall_s": wall,
            "paths": [v.get("paths_sampled") for v in votes]}


def _texts(resps) -> list[str]:
    """The generated texts in lm-eval's nested ``resps`` (lists of lists of str)."""
    if isinstance(resps, str):
        return [resps]
    return [t for r in resps for t in _texts(r)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals serve-sc-lm-eval",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=("synthetic", "gsm8k"), default="synthetic")
    ap.add_argument("--model", help="gsm8k: a local HF model dir (fetch-model smollm2-135m)")
    ap.add_argument("--data", type=Path, default=Path("../shared/data/math/gsm8k_test.jsonl"),
                    help="gsm8k: the test set")
    ap.add_argument("--limit", type=int, default=200, help="test problems")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--temperature", type=float, help="default: 0.8 synthetic, 0.2 gsm8k (the tasks')")
    ap.add_argument("--max-tokens", type=int, help="lm-eval's max_gen_toks (default: 160 synthetic, 256 gsm8k)")
    ap.add_argument("--concurrency", type=int, default=16, help="problems in flight")
    ap.add_argument("--max-num-seqs", default="default", help="an int, or 'default'")
    ap.add_argument("--max-model-len", type=int, help="default: 512 synthetic, 2048 gsm8k")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                    help="on CPU, the share of RAM for weights and KV cache")
    ap.add_argument("--warmup", type=int, default=64,
                    help="synthetic: other problems each server answers untimed first (serve-sc's why)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/serve_sc_lm_eval"))
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    synthetic = args.task == "synthetic"
    if synthetic:
        from consensus_spec.model import model_path

        args.model_dir = model_path()
    elif not args.model:
        ap.error("--task gsm8k needs --model")
    elif not args.data.exists():
        ap.error(f"{args.data} not found: GSM8K comes from ../shared/data/math (see its README)")
    else:
        args.model_dir = args.model
    for name, syn, gsm in (("temperature", 0.8, 0.2), ("max_tokens", 160, 256),
                           ("max_model_len", 512, 2048)):
        if getattr(args, name) is None:
            setattr(args, name, syn if synthetic else gsm)
    if any(c not in CONFIGS for c in configs) or args.runs < 1 or args.n < 1 or args.limit < 1:
        ap.error(f"configs from {CONFIGS}; runs, n, limit >= 1")
    rows = None if args.max_num_seqs == "default" else int(args.max_num_seqs)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    include = Path(tempfile.mkdtemp(prefix="sc_lm_eval_"))
    tasks = synthetic_tasks(include, args.n) if synthetic else \
        task_files(include, args.data.resolve(), args.n)
    records: dict[str, list] = {c: [] for c in configs}
    for run in range(args.runs):
        for config in (configs if run % 2 == 0 else configs[::-1]):
            spec = config == "base-url"
            env = {"VLLM_PLUGINS": PLUGINS} if spec else {}
            flags = server_args(args.model_dir, spec, rows, args.max_model_len, args.dtype,
                                args.gpu_memory_utilization)
            with VllmServer(flags, args.log_dir / f"run{run}_{config}.log", env) as server:
                server.wait_ready()
                if synthetic:
                    warm_up(server.base_url, config, args)
                cpu0, proc0 = server.cpu_s(), time.process_time()
                rec = run_lm_eval(config, args, server.base_url, tasks[config], include)
                rec.update(server_cpu_s=server.cpu_s() - cpu0, client_cpu_s=time.process_time() - proc0,
                           run=run)
            records[config].append(rec)
            print(f"  run {run} {config:8s}: wall {rec['wall_s']:7.1f} s, server CPU "
                  f"{rec['server_cpu_s']:7.1f} s, accuracy {rec['accuracy']:.3f}, distinct "
                  f"completions {statistics.fmean(rec['distinct']):.1f} of {args.n}", flush=True)
    print(markdown(records, args))
    if args.out:
        write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "records": records})
    return 0


def warm_up(base_url: str, config: str, args) -> None:
    """``--warmup`` problems past the timed ones, untimed, as each config sends them."""
    import concurrent.futures as cf

    import requests

    from consensus_spec.model.synthetic import format_prompt, test_set

    route = "/v1/self_consistency/completions" if config == "base-url" else "/v1/completions"
    body = {"model": SERVED, "n": args.n, "temperature": args.temperature,
            "max_tokens": args.max_tokens}
    warm = test_set(args.limit + args.warmup)[args.limit:]
    with cf.ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(lambda p: requests.post(base_url + route, timeout=args.timeout, json={
            **body, "prompt": format_prompt(p["question"])}).raise_for_status(), warm))


def markdown(records: dict, args) -> str:
    what = "the embedded model, its test problems" if args.task == "synthetic" else \
        f"{args.model}, GSM8K 8-shot CoT"
    lines = [f"lm-eval, {what}, {args.limit} problems, n={args.n}, "
             f"T {args.temperature}, concurrency {args.concurrency}, max_num_seqs "
             f"{args.max_num_seqs}, {args.runs} runs (order alternated)", "",
             "| config | wall s per run | x wall vs repeats | server+client CPU s | accuracy per run "
             "(±SE) | distinct completions / problem (min-max) | paths sampled / problem |",
             "|---|---|---|---|---|---|---|"]
    base = records.get("repeats")
    for config, recs in records.items():
        walls = [r["wall_s"] for r in recs]
        ratio = "-" if not base or config == "repeats" else " / ".join(
            f"{b['wall_s'] / r['wall_s']:.2f}" for b, r in zip(base, recs))
        distinct = [d for r in recs for d in r["distinct"]]
        cpu = " / ".join(f"{r['server_cpu_s'] + r['client_cpu_s']:.0f}" for r in recs)
        acc = " / ".join(f"{r['accuracy']:.3f}" for r in recs)
        se = statistics.fmean((r["accuracy_se"] or 0) for r in recs)
        paths = [p for r in recs for p in r["paths"] if p is not None]
        lines.append(
            f"| {config} | {' / '.join(f'{w:.0f}' for w in walls)} | {ratio} | {cpu} "
            f"| {acc} (±{se:.3f}) | {statistics.fmean(distinct) if distinct else 0:.1f} "
            f"({min(distinct, default=0)}-{max(distinct, default=0)}) "
            f"| {statistics.fmean(paths) if paths else args.n:.1f} |")
    return "\n".join(lines)
