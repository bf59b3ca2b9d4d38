"""Recorded multi-sample traces: one JSON object per line with ``prompt`` and
``completions`` (the sibling paths), tokenized for replay."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

SHARED_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "..", "shared", "data")
GPT2_EOS = 50256


class TraceError(ValueError):
    """A trace file that cannot be replayed at all."""


@dataclass
class Problem:
    id: str
    prompt: list[int]
    completions: list[list[int]]  # each ends with EOS


def shared_path(*parts: str) -> str:
    return os.path.normpath(os.path.join(SHARED_DATA, *parts))


def load_tokenizer(path: str | None = None):
    from tokenizers import Tokenizer
    path = path or shared_path("tokenizers", "gpt2", "tokenizer.json")
    if not os.path.exists(path):
        raise TraceError(f"tokenizer not found: {path}")
    return Tokenizer.from_file(path)


def load_problems(path: str, tokenizer, eos_id: int = GPT2_EOS, limit: int | None = None,
                  min_samples: int = 2, log=print) -> list[Problem]:
    """Tokenized problems from a trace file; unusable entries are skipped with a message."""
    if not os.path.exists(path):
        raise TraceError(f"trace file not found: {path}")
    problems: list[Problem] = []
    skipped: dict[str, int] = {}

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(problems) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                skip("invalid JSON")
                continue
            prompt, comps = obj.get("prompt") if isinstance(obj, dict) else None, \
                obj.get("completions") if isinstance(obj, dict) else None
            if not isinstance(prompt, str) or not prompt or not isinstance(comps, list):
                skip("no prompt or completions")
                continue
            comps = [c for c in comps if isinstance(c, str) and c]
            if len(comps) < min_samples:
                skip(f"fewer than {min_samples} non-empty completions")
                continue
            encoded = tokenizer.encode_batch([prompt] + comps)
            problems.append(Problem(
                id=str(obj.get("id", f"line{lineno}")),
                prompt=encoded[0].ids,
                completions=[e.ids + [eos_id] for e in encoded[1:]],
            ))
    for reason, count in skipped.items():
        log(f"{os.path.basename(path)}: skipped {count} entr{'y' if count == 1 else 'ies'}: {reason}")
    if not problems:
        raise TraceError(f"{path}: no replayable problems (need a prompt and >= {min_samples} completions)")
    return problems
