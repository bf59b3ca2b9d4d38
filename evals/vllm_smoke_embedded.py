"""Load the embedded model in vLLM and sample a few reasoning paths.

    python -m evals.vllm_smoke_embedded [--problems 4] [--n 4]

Prints each problem's sampled answers and the pass@1 / majority accuracy over
the problems. Works on vLLM's CPU backend (set VLLM_CPU_KVCACHE_SPACE, in GiB,
to size its KV cache) and on GPU.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter

from consensus_spec.embedded import MODEL_DIR
from consensus_spec.synthetic import extract_answer, format_prompt, test_set


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(MODEL_DIR))
    ap.add_argument("--problems", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.8)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model=args.model, gpu_memory_utilization=0.25, max_model_len=512, seed=0)
    print(f"engine ready in {time.time() - t0:.0f}s")
    probs = test_set(args.problems)
    params = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=256)
    # No per-request seed: vLLM CPU 0.32 fails with "CPU Generator does not use offset".
    # Determinism comes from LLM(seed=0).
    t0 = time.time()
    outs = llm.generate([format_prompt(p["question"]) for p in probs], params)
    print(f"generated in {time.time() - t0:.1f}s")
    hits, maj_hits = 0, 0
    for i, (p, out) in enumerate(zip(probs, outs)):
        answers = [extract_answer(c.text) for c in out.outputs]
        hits += sum(a == p["answer"] for a in answers)
        votes = Counter(a for a in answers if a is not None).most_common(1)
        maj_hits += bool(votes) and votes[0][0] == p["answer"]
        if i < 4:
            print(f"gold={p['answer']} sampled={answers}\n  {out.outputs[0].text!r}")
    n = len(probs)
    print(f"pass@1={hits / (n * args.n):.3f} maj@{args.n}={maj_hits / n:.3f}")


if __name__ == "__main__":
    main()
