"""Measure a step-cost table T(B, q) for the draft budget, in vLLM itself.

    python -m evals step-costs [--model DIR] [--batches 16 64 128 256] [--q 1 2 3 5 9]

Runs the engine in this process with a probe drafter that proposes ``q - 1``
tokens for every row, tokens the model never samples (so every step yields
one token per row), and times whole engine steps: model, sampler, rejection
sampler and scheduler, as a user of the engine sees them. Prints JSON lines
``{"B", "q", "ms"}``, the format of ``../shared/data/costs``, ready for
:class:`consensus_spec.budget.StepCostTable`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DRAFT = {"length": 0, "token": 0}  # what the probe proposes; set between runs


class ProbeProposer:
    """Proposes ``DRAFT["length"]`` copies of ``DRAFT["token"]`` for every row."""

    def __init__(self, vllm_config, **_):
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        return [[DRAFT["token"]] * DRAFT["length"] if s else [] for s in sampled_token_ids]

    def load_model(self, *args, **kwargs) -> None:
        pass


def measure(llm, batch: int, q: int, steps: int, prompt: str) -> float:
    """Milliseconds per engine step with ``batch`` rows verifying ``q`` tokens each."""
    from vllm import SamplingParams

    DRAFT["length"] = q - 1
    params = SamplingParams(n=1, temperature=0.8, max_tokens=steps + 1, ignore_eos=True)
    # warm at this very shape: a first use can compile or allocate, which is no step cost
    llm.generate([prompt] * batch, SamplingParams(n=1, max_tokens=4, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([prompt] * batch, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    produced = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return wall * 1000 / max(produced / batch, 1)  # one token per row per step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals step-costs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: the embedded model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--q", type=int, nargs="+", default=[1, 2, 3, 5, 9], help="tokens per row per step")
    ap.add_argument("--steps", type=int, default=48, help="decode steps timed per point")
    ap.add_argument("--out", help="also write the JSON lines here")
    args = ap.parse_args(argv)
    if min(args.batches) < 1 or min(args.q) < 1 or args.steps < 2:
        ap.error("--batches and --q must be >= 1 and --steps >= 2")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the probe's settings live in this process
    from vllm import LLM

    from consensus_spec.model import model_path

    model = args.model or model_path()
    import torch

    # as the evals run it: eager on CPU (CUDA graphs on a GPU)
    llm = LLM(model=model, gpu_memory_utilization=0.25, max_num_seqs=max(args.batches),
              enforce_eager=not torch.cuda.is_available(),
              speculative_config={"method": "custom_class", "model": f"{__name__}.ProbeProposer",
                                  "num_speculative_tokens": max(args.q) - 1})
    DRAFT["token"] = llm.get_tokenizer().vocab_size - 1  # rarely, if ever, sampled
    prompt = "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:"
    rows = []
    for batch in args.batches:
        for q in args.q:
            ms = measure(llm, batch, q, args.steps, prompt)
            rows.append({"model": os.path.basename(model.rstrip("/")), "B": batch, "q": q, "ms": round(ms, 4)})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
