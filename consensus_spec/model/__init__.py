"""The embedded default model: location and tokenizer construction.

The model in ``consensus_spec/model`` is a tiny Llama trained by
``python -m consensus_spec.model.train`` on :mod:`consensus_spec.model.synthetic`.
Its tokenizer is a byte-level BPE with every digit its own token; the
tokenizer adds BOS to each encoded text, and generation stops at EOS.
Prompts use :func:`consensus_spec.model.synthetic.format_prompt`.
"""

from __future__ import annotations

import json
from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent  # this package holds the weights
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"

# Renders a single user turn into the plain training prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "Question: {{ m['content'] }}\nAnswer:{% elif m['role'] == 'assistant' %}"
    " {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def model_path() -> str:
    """Path of the shipped model directory (raises if it is missing)."""
    if not (MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(f"embedded model not found in {MODEL_DIR}")
    return str(MODEL_DIR)


def build_tokenizer(texts, vocab_size: int = 1024):
    """Train a byte-level BPE on ``texts``; digits are always single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def save_tokenizer(tok, out_dir, model_max_length: int = 512) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` loadable by AutoTokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
