"""Corrupted proposer inputs on chosen replay steps: nothing may escape
``propose()``, every row still gets a (possibly empty) draft list, and
drafting quality over the run stays close to a clean run.

    python -m evals faults [--traces FILE] [--batch 64] [--every 500] [--limit N]

Corruptions, cycled over the faulty steps: negative token ids, ids >= 2^21
(the trie's token limit), lengths past the token buffer, and ragged sampled
lists (too long, empty, not lists). Each corrupts a quarter of the rows of a
copy of vLLM's inputs, so the replay itself stays correct.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from consensus_spec import ConsensusProposer

from .drafters import stand_in_config
from .engine import replay
from ..traces import TraceError, load_problems, load_tokenizer, shared_path

KINDS = ("negative_ids", "huge_ids", "past_buffer", "ragged")


def corrupt(kind: str, sampled, num_tokens, tokens, rng):
    """Copies of the three proposer inputs with a quarter of the rows broken."""
    sampled = [list(s) for s in sampled]
    num_tokens, tokens = num_tokens.copy(), tokens.copy()
    rows = len(sampled)
    bad = rng.choice(rows, size=max(1, rows // 4), replace=False)
    for i in bad.tolist():
        end = int(num_tokens[i])
        if kind == "negative_ids":
            tokens[i, max(end - 1, 0)] = -3
        elif kind == "huge_ids":
            tokens[i, max(end - 1, 0)] = (1 << 21) + 5
        elif kind == "past_buffer":
            num_tokens[i] = tokens.shape[1] + 50
        elif kind == "ragged":
            sampled[i] = [[7] * 300, [], None][i % 3]
    return sampled, num_tokens, tokens


def run(problems, batch: int, k: int, every: int, seed: int = 0):
    max_len = max(len(p.prompt) + max(map(len, p.completions)) for p in problems) + k + 2
    cfg = stand_in_config(k, max_len, batch)
    result = {}
    for label in ("clean", "corrupted"):
        proposer = ConsensusProposer(cfg)
        rng = np.random.default_rng(seed)
        calls = [0]
        escaped = []
        wrong_shape = [0]

        def drafter(sampled, b, proposer=proposer, rng=rng, calls=calls, escaped=escaped,
                    wrong_shape=wrong_shape, faulty=label == "corrupted"):
            calls[0] += 1
            args = (sampled, b.num_tokens_no_spec, b.token_ids_cpu)
            if faulty and calls[0] % every == 0:
                kind = KINDS[(calls[0] // every - 1) % len(KINDS)]
                args = corrupt(kind, *args, rng)
            try:
                drafts = proposer.propose(*args)
            except Exception as e:  # noqa: BLE001 - counted: the target is none
                escaped.append(repr(e))
                drafts = [[] for _ in sampled]
            if not isinstance(drafts, list) or len(drafts) != len(sampled):
                wrong_shape[0] += 1
                drafts = [[] for _ in sampled]
            return drafts

        stats = replay(problems, drafter, "consensus", k, batch)
        result[label] = {"tau": stats.tau, "steps": calls[0], "escaped": escaped,
                         "wrong_shape": wrong_shape[0], **proposer.counters()}
    result["corrupted_steps"] = result["corrupted"]["steps"] // every
    result["tau_ratio"] = result["corrupted"]["tau"] / result["clean"]["tau"]
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals faults", description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default=shared_path("traces", "gsm8k_qwen3_4b_n8.jsonl"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--every", type=int, default=500, help="corrupt every Nth propose call")
    ap.add_argument("--limit", type=int)
    args = ap.parse_args(argv)
    try:
        problems = load_problems(args.traces, load_tokenizer(), limit=args.limit)
    except (TraceError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    r = run(problems, args.batch, args.k, args.every)
    print(f"| run | propose calls | corrupted calls | escaped exceptions | wrong-shape returns | "
          f"failed steps | resets | tau |\n|---|---|---|---|---|---|---|---|")
    for label in ("clean", "corrupted"):
        x = r[label]
        print(f"| {label} | {x['steps']} | {r['corrupted_steps'] if label == 'corrupted' else 0} | "
              f"{len(x['escaped'])} | {x['wrong_shape']} | {x['num_failures']} | {x['num_resets']} | "
              f"{x['tau']:.3f} |")
    print(f"\ntau corrupted / clean: {r['tau_ratio']:.3f}")
    return 0 if not r["corrupted"]["escaped"] and not r["corrupted"]["wrong_shape"] else 1


if __name__ == "__main__":
    sys.exit(main())
