"""Run one vLLM engine over the engine-test workload and dump its outputs.

    python -m tests.engine_run MODEL METHOD OUT.json {greedy,mixed,dist,dist_top}

METHOD: none, ngram, consensus, consensus_unpatched (consensus with the
rejection-sampler patches off), nodraft (speculation configured, a proposer
that never drafts), or fault_first / fault_middle / fault_every (consensus
with its drafter failing on those propose calls).

Each engine runs in its own process so the KV cache is freed between runs.
The engine is configured so that every case the proposer must survive
happens: chunked prefill (small token budget), prefix caching, preemption
(few KV blocks), condensed and reused rows (requests of mixed length and
n), prompts sharing a long prefix, a request reaching max_model_len, stop
strings, and EOS.
"""

from __future__ import annotations

import json
import os
import random
import sys

MAX_MODEL_LEN = 256


DIST_SAMPLES = 1000
DIST_TOP_SAMPLES = 30000  # dist_top: samples of one prompt, in requests of 1,000
DIST_TOP_TOKENS = 3  # and tokens each
UNPATCHED = "plain_steps,recovered_tokens"  # consensus_unpatched's CONSENSUS_SPEC_SKIP_FIXES
FAULTS = {"fault_first": {"steps": [1]}, "fault_middle": {"steps": [40, 41, 120]},
          "fault_every": {"every": True}}
GREEDY_SAMPLED_TAIL = 2  # sampled requests at the end of the greedy workload


def workload(vocab: list[str], mode: str):
    """(prompt, sampling kwargs) pairs; deterministic."""
    rng = random.Random(0)

    def words(n):
        return " ".join(rng.choice(vocab) for _ in range(n))

    if mode == "dist":  # many samples of one prompt
        return [(words(12), dict(n=DIST_SAMPLES, temperature=0.8, max_tokens=8))]
    if mode == "dist_top":  # very many samples of one prompt, a few tokens each
        prompt = words(12)
        return [(prompt, dict(n=1000, temperature=0.8, max_tokens=DIST_TOP_TOKENS))] * (DIST_TOP_SAMPLES // 1000)
    if mode == "mixed":  # n = 1, 4 and 16 in one batch; seeded ones with chunked prefills
        reqs = [(words(15), dict(n=n, temperature=0.8, max_tokens=48)) for n in (1, 4, 16, 1)]
        reqs += [(words(150), dict(n=4, temperature=0.8, max_tokens=32, seed=7)),
                 (words(120), dict(n=1, temperature=0.8, top_p=0.9, max_tokens=32, seed=8))]
        return reqs
    greedy = dict(n=1, temperature=0.0)
    reqs = []
    for i in range(40):  # plain requests of varied length
        reqs.append((words(rng.randint(3, 40)), dict(greedy, max_tokens=rng.randint(8, 64))))
    shared = words(150)  # long common prefix, different questions
    for i in range(10):
        reqs.append((shared + " " + words(5), dict(greedy, max_tokens=48)))
    for copies in (4, 16):  # sibling groups: greedy siblings are identical
        prompt = words(20)
        reqs += [(prompt, dict(greedy, max_tokens=64))] * copies
    reqs.append((words(230), dict(greedy, max_tokens=100)))  # runs into max_model_len
    for i in range(4):
        reqs.append((words(10), dict(greedy, max_tokens=64, stop=[vocab[5 + i], vocab[9 + i]])))
    for i in range(4):
        reqs.append((words(10), dict(greedy, max_tokens=200)))
    # Sampled n > 1 in the same batch (last, not compared token by token: the
    # RNG stream differs with drafts).
    reqs.append((words(15), dict(n=4, temperature=0.8, max_tokens=48)))
    reqs.append((words(15), dict(n=16, temperature=0.8, max_tokens=48)))
    return reqs


class NoDraftProposer:
    """Speculation configured, nothing ever drafted: every step is undrafted."""

    def __init__(self, vllm_config, **_):
        pass

    def propose(self, sampled_token_ids, *args, **kwargs):
        return [[] for _ in sampled_token_ids]

    def load_model(self, *args, **kwargs) -> None:
        pass


def find_proposer(llm):
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner.drafter


def main(argv=None) -> int:
    model, method, out, mode = (argv or sys.argv[1:])[:4]
    if mode not in ("greedy", "mixed", "dist", "dist_top"):
        raise SystemExit(f"unknown mode {mode!r}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # proposer reachable in-process
    if method == "consensus_unpatched":
        os.environ["CONSENSUS_SPEC_SKIP_FIXES"] = UNPATCHED  # read when vLLM loads its plugins
        method = "consensus"
    from vllm import LLM, SamplingParams

    from consensus_spec import engine_args
    from consensus_spec.vllm import compat

    spec = {"consensus": engine_args(num_speculative_tokens=8)["speculative_config"],
            "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
                      "prompt_lookup_min": 2}}.get(method)
    extra = {}
    if method == "nodraft":
        spec = {"method": "custom_class", "model": f"{__name__}.NoDraftProposer",
                "num_speculative_tokens": 8}
    if method == "consensus":
        # the lossless, distribution and row-tracking tests need drafts to
        # verify, however costly this machine makes drafting look to the
        # budget while it learns (tested on its own): draft whenever confident
        args = engine_args(num_speculative_tokens=8, cost_model="off")
        spec, extra = args["speculative_config"], args["additional_config"]
    if method in FAULTS:
        spec = {"method": "custom_class", "model": "tests.faulty_proposer.FaultyProposer",
                "num_speculative_tokens": 8}
        # what is tested is containment, not the budget: drafting must resume
        # however costly this machine makes drafts look while it learns
        extra = {"fault_injection": FAULTS[method], "consensus_spec": {"cost_model": "off"}}
    big = mode == "dist_top"  # throughput, not batch events
    llm = LLM(model, speculative_config=spec, additional_config=extra, dtype="float32", seed=0,
              max_model_len=MAX_MODEL_LEN,
              enable_prefix_caching=True, enable_chunked_prefill=True,
              max_num_batched_tokens=1024 if big else 96, max_num_seqs=128 if big else 24,
              num_gpu_blocks_override=512 if big else int(os.environ.get("ENGINE_TEST_BLOCKS", 6)),
              gpu_memory_utilization=0.15, enforce_eager=True, disable_log_stats=False)
    vocab = sorted(llm.get_tokenizer().get_vocab())
    vocab = [w for w in vocab if w.isalpha() or w.isdigit()]
    reqs = workload(vocab, mode)
    outs = llm.generate([p for p, _ in reqs], [SamplingParams(**kw) for _, kw in reqs], use_tqdm=False)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
               if hasattr(m, "value")}
    result = {
        "outputs": [[list(c.token_ids) for c in o.outputs] for o in outs],
        "finish": [[c.finish_reason for c in o.outputs] for o in outs],
        "prompt_len": [len(o.prompt_token_ids) for o in outs],
        "metrics": metrics,
        "vllm_patches": compat.active(),
    }
    if method == "consensus" or method in FAULTS:
        p = find_proposer(llm)
        result["proposer"] = {"paths_started": p.rows.paths_started, "paths_resumed": p.rows.paths_resumed,
                              "groups": p.drafter.num_groups, "drafted": p.num_drafted,
                              "accepted": p.num_accepted, **p.counters()}
        if method in FAULTS:
            result["proposer"].update(calls=p.calls, faults=p.faults)
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
