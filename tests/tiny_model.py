"""A tiny random-weight Llama with a word-level tokenizer, built on the fly
for engine tests (no hub access needed)."""

from __future__ import annotations

import json
import os

WORDS = ("the a one two three four five six seven eight nine ten plus minus times is "
         "and so we have then answer total each apples cars more less left gives").split()


def build_tiny_llama(path: str, seed: int = 0, vocab_extra: int = 200, init_std: float = 0.5) -> str:
    """Write config, random weights and a tokenizer to ``path``; return it."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in WORDS + [str(i) for i in range(vocab_extra)]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="</s>")
    fast.save_pretrained(path)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2, tie_word_embeddings=True, torch_dtype="float32",
                      initializer_range=init_std)  # large weights: varied text, clear argmax
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return path
