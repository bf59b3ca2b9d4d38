"""Two rollout batches in one ``LLM`` with a weight reload between them, as
an RL trainer runs them, with speculation off and with consensus drafting.

    python -m tests.rollout_reload OUT.json [greedy|sampled]

Each engine (the embedded model, in this process) runs batch 1 (P prompts x
G samples through ``LLM.generate``; greedy: G separate requests, as vLLM
takes greedy requests with n=1 only), reloads its weights in place through
vLLM's ``reload_weights`` path (``LLM.collective_rpc``; the checkpoint's
tensors with seeded noise, a stand-in for a policy update, the same in both
engines), and runs batch 2 on the same prompts.  Written to OUT.json: every
output's token ids per engine and batch, the process's resident memory and
the proposer's memory counters after each batch, its acceptance per batch.

``sampled`` (T 1.0) measures whether batch 1's text should seed batch 2's
drafts: a third engine drops its tries after the reload
(``ConsensusDrafter.drop_tries``), so batch 2 drafts from its own siblings only.
"""

from __future__ import annotations

import json
import os
import sys
import time

P, G, MAX_TOKENS = 8, 4, 48
NOISE = 0.05  # of each weight matrix's std: enough to move greedy outputs
MEMORY_KEYS = ("arena_bytes", "trie_nodes", "live_groups", "live_paths", "path_slots", "parked_paths",
               "num_groups")


def reload_perturbed(worker, scale: float) -> int:
    """In the worker: the checkpoint's tensors, matrices with seeded noise,
    loaded in place (the path trainers' weight syncs take)."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(worker.vllm_config.model_config.model, "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    weights = []
    for name in sorted(tensors):
        t = tensors[name]
        if t.dim() > 1 and scale:
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            t = (t.float() + scale * t.float().std() * noise).to(t.dtype)
        weights.append((name, t))
    worker.reload_weights(weights_iterator=iter(weights))
    return len(weights)


def drop_tries(worker) -> bool:
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    inner = getattr(drafter, "drafter", None)
    if inner is None:
        return False
    inner.drop_tries()
    return True


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_engine(method: str, mode: str, forget: bool = False) -> dict:
    from vllm import LLM, SamplingParams

    from consensus_spec import engine_args
    from consensus_spec.model import model_path
    from consensus_spec.model.synthetic import format_prompt, test_set

    spec = engine_args(8) if method == "consensus" else {}
    llm = LLM(model=model_path(), dtype="float32", max_model_len=256, gpu_memory_utilization=0.2,
              enforce_eager=True, seed=0, max_num_seqs=P * G, **spec)
    prompts = [format_prompt(r["question"]) for r in test_set(n=P)]
    temperature = 0.0 if mode == "greedy" else 1.0
    if mode == "greedy":  # vLLM takes greedy requests with n=1 only: G separate requests
        prompts = [p for p in prompts for _ in range(G)]
    params = SamplingParams(n=1 if mode == "greedy" else G, temperature=temperature, max_tokens=MAX_TOKENS)
    out = {"method": method, "forget": forget, "batches": []}
    try:
        for batch in range(2):
            if batch == 1:
                out["reloaded_tensors"] = llm.collective_rpc(reload_perturbed, args=(NOISE,))[0]
                if forget:
                    out["dropped"] = llm.collective_rpc(drop_tries)[0]
            before = _counters(llm)
            t0 = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            after = _counters(llm)
            drafted = (after or {}).get("num_drafted", 0) - (before or {}).get("num_drafted", 0)
            accepted = (after or {}).get("num_accepted", 0) - (before or {}).get("num_accepted", 0)
            out["batches"].append({
                "token_ids": [list(c.token_ids) for r in results for c in r.outputs],
                "wall_s": wall, "rss_bytes": rss_bytes(), "drafted": drafted, "accepted": accepted,
                "tokens": sum(len(c.token_ids) for r in results for c in r.outputs),
                "proposer": {k: after[k] for k in MEMORY_KEYS if k in after} if after else None})
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return out


def _counters(llm):
    from evals.math.llm import proposer_counters

    return proposer_counters(llm)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path, mode = argv[0], (argv[1] if len(argv) > 1 else "greedy")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    runs = [run_engine("none", mode), run_engine("consensus", mode)]
    if mode == "sampled":
        runs.append(run_engine("consensus", mode, forget=True))
    with open(path, "w") as f:
        json.dump(runs, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
