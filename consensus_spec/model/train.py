"""Train the embedded default model (tiny Llama) on the synthetic arithmetic corpus.

    python -m consensus_spec.model.train --out consensus_spec/model

CPU only and seeded: the same arguments and library versions give the same
model. Loss is on the solution tokens (and EOS) only. Writes config.json,
model.safetensors (bf16), generation_config.json, tokenizer files and
TRAINING.md to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch

from consensus_spec.model import EOS, PAD, build_tokenizer, save_tokenizer
from consensus_spec.model.synthetic import format_example, generate_problems


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m consensus_spec.model.train", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="consensus_spec/model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-train", type=int, default=40000, help="training problems")
    ap.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--max-pos", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--snapshots", default="", help="comma list of steps to also save (tuning)")
    return ap.parse_args(argv)


def encode(tok, problems, eos_id):
    """Token ids and labels (-100 on the prompt) for each problem."""
    data = []
    for p in problems:
        prompt, completion = format_example(p)
        a = tok.encode(prompt).ids  # post-processor prepends BOS
        b = tok.encode(completion, add_special_tokens=False).ids + [eos_id]
        data.append((a + b, [-100] * len(a) + b))
    return data


def batches(data, batch, pad_id, rng, pool=64):
    """Endless shuffled batches, right-padded to the longest row.

    Rows are grouped by length within pools of ``pool`` batches to cut padding.
    """
    order = list(range(len(data)))
    while True:
        rng.shuffle(order)
        groups = []
        for s in range(0, len(order), batch * pool):
            chunk = sorted(order[s:s + batch * pool], key=lambda j: len(data[j][0]))
            groups += [chunk[i:i + batch] for i in range(0, len(chunk) - batch + 1, batch)]
        rng.shuffle(groups)
        for group in groups:
            rows = [data[j] for j in group]
            width = max(len(ids) for ids, _ in rows)
            ids = torch.full((batch, width), pad_id)
            labels = torch.full((batch, width), -100)
            mask = torch.zeros((batch, width), dtype=torch.long)
            for r, (x, y) in enumerate(rows):
                ids[r, :len(x)] = torch.tensor(x)
                labels[r, :len(y)] = torch.tensor(y)
                mask[r, :len(x)] = 1
            yield ids, labels, mask


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def build_model(args, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_pos,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id("<|bos|>"),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
    )
    return LlamaForCausalLM(config)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    t0 = time.time()

    problems = generate_problems(args.n_train, seed=args.seed)
    texts = [" ".join(format_example(p)) for p in problems[:20000]]
    tok = build_tokenizer(texts, vocab_size=args.vocab)
    eos_id, pad_id = tok.token_to_id(EOS), tok.token_to_id(PAD)
    data = [d for d in encode(tok, problems, eos_id) if len(d[0]) <= args.max_pos]
    n_tok = sum(len(x) for x, _ in data)
    print(f"vocab={tok.get_vocab_size()} examples={len(data)} tokens={n_tok} "
          f"mean_len={n_tok / len(data):.1f}", flush=True)

    model = build_model(args, tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params={n_params / 1e6:.2f}M", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    stream = batches(data, args.batch, pad_id, random.Random(args.seed))
    model.train()
    seen, running = 0, None
    for step in range(args.steps):
        ids, labels, mask = next(stream)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seen += int(mask.sum())
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d} loss {loss.item():.4f} avg {running:.4f} "
                  f"lr {lr_at(step, args):.2e} tokens {seen} "
                  f"elapsed {time.time() - t0:.0f}s", flush=True)
        if str(step + 1) in args.snapshots.split(","):
            save(model, tok, args, Path(args.out) / f"step-{step + 1}")
    wall = time.time() - t0
    out = Path(args.out)
    save(model, tok, args, out)
    write_report(out, args, argv, wall, n_params, seen, running, len(data))
    print(f"saved to {out} in {wall:.0f}s", flush=True)


def save(model, tok, args, out):
    """Save a bf16 copy of ``model`` plus tokenizer files to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    model = copy.deepcopy(model).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config.do_sample = True
    model.generation_config.temperature = 0.8
    model.generation_config.max_new_tokens = 256
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tok, out, model_max_length=args.max_pos)


def write_report(out, args, argv, wall, n_params, seen, final_loss, n_examples):
    import transformers

    cmd = "python -m consensus_spec.model.train " + " ".join(argv if argv is not None else sys.argv[1:])
    settings = "\n".join(f"| {k} | {v} |" for k, v in vars(args).items())
    (out / "TRAINING.md").write_text(f"""# Embedded default model

Tiny Llama ({n_params / 1e6:.2f}M parameters, head_dim {args.hidden // args.heads}, bf16)
trained from scratch on `consensus_spec.model.synthetic` arithmetic word problems
(2-4 steps, chain-of-thought solutions ending in "The answer is N.").

Prompt: `Question: <question>\\nAnswer:` (the tokenizer prepends `<|bos|>`);
the model continues with ` <solution>` and stops at `<|eos|>`.

- Command: `{cmd.strip()}`
- Wall time: {wall / 60:.1f} min ({wall:.0f} s), CPU only, {args.threads} threads
- Machine: {platform.machine()} {platform.processor() or ''}, {platform.system()}; shared 2-core VM
- torch {torch.__version__}, transformers {transformers.__version__}
- Training problems: {n_examples}; tokens processed: {seen}; final smoothed loss: {final_loss:.4f}
  (solution tokens only)

| setting | value |
|---|---|
{settings}
""")


if __name__ == "__main__":
    main()
