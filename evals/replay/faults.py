"""Corrupted proposer inputs and failing drafting steps on chosen replay
steps: nothing may escape ``propose()``, every row still gets a (possibly
empty) draft list, and drafting quality stays close to a clean run.

    python -m evals faults [--traces FILE] [--batch 64] [--every 500] [--limit N]

Three runs of the same traces, side by side:

- clean;
- corrupted: on every ``--every``-th call, cycled: negative token ids, ids
  >= 2^21 (the trie's token limit), lengths past the token buffer, and
  ragged sampled lists (too long, empty, not lists), each in a quarter of
  the rows of a copy of vLLM's inputs (so the replay itself stays correct);
- reset: on every ``--every``-th call the drafter raises inside the step,
  as a bug would; the proposer contains it and rebuilds its tries. Tau in
  the 10-step windows after each failure, against the clean run's over the
  same steps, shows how fast drafting recovers.
"""

from __future__ import annotations

import argparse

import numpy as np

from consensus_spec import ConsensusProposer

from ..options import fail, write_json
from ..traces import TraceError, load_problems, load_tokenizer, max_len, shared_path
from .drafters import stand_in_config
from .engine import replay

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


def fail_once(proposer) -> None:
    """Make the proposer's next drafting call raise, as a bug in it would."""
    drafter = proposer.drafter
    real = drafter.extend_and_draft

    def boom(*args, **kwargs):
        drafter.extend_and_draft = real
        raise RuntimeError("injected drafter failure")
    drafter.extend_and_draft = boom


WINDOW, WINDOWS = 10, 5  # recovery: 10-step windows, the first 50 steps after a failure


def run(problems, batch: int, k: int, every: int, seed: int = 0):
    cfg = stand_in_config(k, max_len(problems, k), batch)
    result = {}
    curves = {}
    for label in ("clean", "corrupted", "reset"):
        proposer = ConsensusProposer(cfg, online_costs=False)  # no wall-clock learning: the
        #                                                       three runs differ by the faults alone
        rng = np.random.default_rng(seed)
        run = {"steps": 0, "escaped": [], "wrong_shape": 0}
        curve = curves[label] = [(0, 0)]  # cumulative (tokens, row steps) after each step

        def drafter(sampled, b):
            run["steps"] += 1
            args = (sampled, b.num_tokens_no_spec, b.token_ids_cpu)
            if label == "corrupted" and run["steps"] % every == 0:
                kind = KINDS[(run["steps"] // every - 1) % len(KINDS)]
                args = corrupt(kind, *args, rng)
            if label == "reset" and run["steps"] % every == 0:
                fail_once(proposer)
            try:
                drafts = proposer.propose(*args)
            except Exception as e:  # noqa: BLE001 - counted: the target is none
                run["escaped"].append(repr(e))
                drafts = [[] for _ in sampled]
            if not isinstance(drafts, list) or len(drafts) != len(sampled):
                run["wrong_shape"] += 1
                drafts = [[] for _ in sampled]
            return drafts

        stats = replay(problems, drafter, "consensus", k, batch,
                       on_step=lambda st: curve.append((st.tokens, st.row_steps)))
        result[label] = {"tau": stats.tau, **run, **proposer.counters()}
    result["corrupted_steps"] = result["corrupted"]["steps"] // every
    result["tau_ratio"] = result["corrupted"]["tau"] / result["clean"]["tau"]
    result["reset_tau_ratio"] = result["reset"]["tau"] / result["clean"]["tau"]
    result["recovery"] = recovery(curves["clean"], curves["reset"], every)
    result["recovery_corrupted"] = recovery(curves["clean"], curves["corrupted"], every)  # noise
    return result


def recovery(clean, reset, every: int) -> list[float]:
    """Per 10-step window after a failure (steps f+1..f+10, ...), tau of the
    reset run over the clean run's in the same steps, pooled over failures."""
    def tau(curve, a, b):
        (t0, r0), (t1, r1) = curve[a], curve[b]
        return (t1 - t0) / max(r1 - r0, 1), r1 - r0
    out = []
    last = min(len(clean), len(reset)) - 1
    for w in range(WINDOWS):
        num = den = 0.0
        for f in range(every, last, every):
            a, b = f + w * WINDOW, f + (w + 1) * WINDOW
            if b > last:
                break
            (tr, n), (tc, _) = tau(reset, a, b), tau(clean, a, b)
            num += tr * n
            den += tc * n
        out.append(num / den if den else float("nan"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals faults", description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default=shared_path("traces", "gsm8k_qwen3_4b_n8.jsonl"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--every", type=int, default=500, help="corrupt every Nth propose call")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--tokenizer", help="tokenizer.json (default: shared GPT-2; traces with ids need none)")
    ap.add_argument("--out", help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    try:
        problems = load_problems(args.traces, load_tokenizer(args.tokenizer), limit=args.limit)
    except (TraceError, FileNotFoundError) as e:
        return fail(e)
    r = run(problems, args.batch, args.k, args.every)
    print("| run | propose calls | faulty calls | escaped exceptions | wrong-shape returns | "
          "rows rejected | failed steps | resets (regrouped) | tau |\n|---|---|---|---|---|---|---|---|---|")
    for label in ("clean", "corrupted", "reset"):
        x = r[label]
        print(f"| {label} | {x['steps']} | {r['corrupted_steps'] if label != 'clean' else 0} | "
              f"{len(x['escaped'])} | {x['wrong_shape']} | {x['rows_rejected']} | "
              f"{x['num_failures']} | {x['num_resets']} ({x['num_regroups']}) | {x['tau']:.3f} |")
    print(f"\ntau corrupted / clean: {r['tau_ratio']:.3f}; reset / clean: {r['reset_tau_ratio']:.3f}")
    for key, what in (("recovery", "failure (reset run)"),
                      ("recovery_corrupted", "corrupted call (for scale)")):
        print(f"after each {what}, tau / clean per 10 steps: "
              + ", ".join(f"{w * WINDOW + 1}-{(w + 1) * WINDOW}: {x:.3f}"
                          for w, x in enumerate(r[key])))
    if args.out:
        write_json(args.out, r)
    bad = any(r[x]["escaped"] or r[x]["wrong_shape"] for x in ("corrupted", "reset"))
    return 1 if bad else 0
