"""Sanity-check the embedded model with a plain transformers sampling loop.

    python -m evals.check_embedded --problems 100 --n 16 --temperature 0.8

Reports pass@1 (mean per-sample accuracy) and majority-vote@n accuracy on
held-out ``synthetic.test_set`` problems. CPU only.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch

from consensus_spec.embedded import MODEL_DIR
from consensus_spec.synthetic import extract_answer, format_prompt, test_set


def majority(answers):
    """Most common non-None answer (ties: first seen), or None."""
    votes = Counter(a for a in answers if a is not None)
    return votes.most_common(1)[0][0] if votes else None


def sample(model, tok, prompt, n, temperature, max_new_tokens):
    enc = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **enc, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
            num_return_sequences=n, max_new_tokens=max_new_tokens,
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        )
    return tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(MODEL_DIR))
    ap.add_argument("--problems", type=int, default=100)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--show", type=int, default=0, help="print samples for this many problems")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    probs = test_set(args.problems)
    t0 = time.time()
    per_sample, maj_hits, distinct, by_steps = [], [], [], {}
    for i, p in enumerate(probs):
        texts = sample(model, tok, format_prompt(p["question"]), args.n,
                       args.temperature, args.max_new_tokens)
        answers = [extract_answer(t) for t in texts]
        acc = sum(a == p["answer"] for a in answers) / len(answers)
        per_sample.append(acc)
        maj_hits.append(majority(answers) == p["answer"])
        distinct.append(len(set(answers)))
        by_steps.setdefault(p["steps"], []).append(acc)
        if i < args.show:
            print(f"Q: {p['question']}  [gold {p['answer']}]\n--- {texts[0]}\n--- {texts[1]}\n")
    n = len(probs)
    pass1, maj = sum(per_sample) / n, sum(maj_hits) / n
    print(f"problems={n} n={args.n} T={args.temperature} time={time.time() - t0:.0f}s")
    print(f"pass@1={pass1:.3f} maj@{args.n}={maj:.3f} gap={maj - pass1:+.3f} "
          f"mean_distinct_answers={sum(distinct) / n:.2f}")
    hist = Counter(min(int(a * 4), 3) for a in per_sample)
    print("per-problem accuracy histogram [0-.25,.25-.5,.5-.75,.75-1]:",
          [hist.get(b, 0) for b in range(4)])
    for s in sorted(by_steps):
        v = by_steps[s]
        print(f"  steps={s}: pass@1={sum(v) / len(v):.3f} (n={len(v)})")
    return pass1, maj


if __name__ == "__main__":
    main()
