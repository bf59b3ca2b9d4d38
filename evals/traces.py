"""Recorded multi-sample traces: one JSON object per line with ``prompt`` and
``completions`` (the sibling paths), tokenized for replay.

Lines that ``python -m evals record`` wrote carry their token ids
(``prompt_ids``, ``completion_ids``, ``meta.eos_token_id``): those are
replayed as recorded, without a tokenizer.  Text-only lines (the shared
traces) are tokenized; :func:`load_tokenizer` loads its tokenizer.json only
when such a line needs it.

Every reader of these files reads them through :class:`TraceLines`: a line
that is not a JSON object is an error naming the file and the line, unless
the caller asks to skip such lines; what is skipped is counted and reported."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

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


class TraceLines:
    """The objects of one JSONL trace file, in order, with their line numbers.

    A line that is not a JSON object (not UTF-8, not valid JSON, or another
    JSON value) is a :class:`TraceError` naming the file and the line, unless
    ``skip_bad``: then it is skipped and its number kept.  Readers count the
    entries they cannot use with :meth:`skip`; :meth:`report` says what was
    skipped."""

    def __init__(self, path: str, skip_bad: bool = False):
        if not os.path.exists(path):
            raise TraceError(f"trace file not found: {path}")
        self.path, self.skip_bad = path, skip_bad
        self.bad_lines: list[int] = []
        self.skipped: Counter[str] = Counter()  # reason: entries skipped for it

    def __iter__(self):
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw.decode("utf-8"))
                except ValueError as e:  # not UTF-8, or not JSON
                    obj = e
                if isinstance(obj, dict):
                    yield lineno, obj
                elif self.skip_bad:
                    self.bad_lines.append(lineno)
                else:
                    why = f"not valid JSON ({getattr(obj, 'msg', obj)})" if isinstance(obj, ValueError) \
                        else "not a JSON object"
                    raise TraceError(f"{self.path}, line {lineno}: {why}")

    def skip(self, reason: str) -> None:
        """Count an entry the reader cannot use."""
        self.skipped[reason] += 1

    def report(self, log=None) -> None:
        """A line for the bad lines and one per reason entries were skipped
        for (``log``: default, print to stderr)."""
        log = log or (lambda message: print(message, file=sys.stderr))
        name, bad = os.path.basename(self.path), self.bad_lines
        if bad:
            log(f"{name}: skipped {len(bad)} line(s) not a JSON object: "
                + ", ".join(map(str, bad[:5])) + ", ..." * (len(bad) > 5))
        for reason, count in self.skipped.items():
            log(f"{name}: skipped {count} entr{'y' if count == 1 else 'ies'}: {reason}")


def trace_id(obj: dict, lineno: int) -> str:
    """A line's problem id: its ``id``, else ``line<N>``."""
    return str(obj.get("id", f"line{lineno}"))


def completion_texts(obj: dict) -> list[str]:
    """A line's non-empty completion texts, in order."""
    comps = obj.get("completions")
    return [c for c in comps if isinstance(c, str) and c] if isinstance(comps, list) else []


def shared_path(*parts: str) -> str:
    return os.path.normpath(os.path.join(SHARED_DATA, *parts))


def max_len(problems: list[Problem], k: int) -> int:
    """Tokens a replay row needs: the longest prompt + path, ``k`` drafts and 2."""
    return max(len(p.prompt) + max(map(len, p.completions)) for p in problems) + k + 2


class TraceTokenizer:
    """A ``tokenizers.Tokenizer`` loaded on first use, which also knows the
    texts of recorded lines :func:`load_problems` read (their recorded ids,
    EOS left off), so replaying a recorded file never loads a tokenizer."""

    def __init__(self, path: str):
        self.path = path
        self._tokenizer = None
        self._known: dict[str, list[int]] = {}

    def remember(self, texts: list[str], ids: list[list[int]]) -> None:
        self._known.update(zip(texts, ids))

    def load(self):
        if self._tokenizer is None:
            if not os.path.exists(self.path):
                raise TraceError(f"tokenizer not found: {self.path} (text traces need one; "
                                 "pass --tokenizer, or record traces with token ids: python -m evals record)")
            from tokenizers import Tokenizer
            self._tokenizer = Tokenizer.from_file(self.path)
        return self._tokenizer

    def encode_batch(self, texts: list[str]):
        if all(t in self._known for t in texts):
            return [SimpleNamespace(ids=self._known[t]) for t in texts]  # as a tokenizer's encodings
        return self.load().encode_batch(texts)


def load_tokenizer(path: str | None = None) -> TraceTokenizer:
    """The tokenizer for text traces (default: the shared GPT-2), loaded when
    first needed; a ``path`` given explicitly must exist now."""
    if path is not None and not os.path.exists(path):
        raise TraceError(f"tokenizer not found: {path}")
    return TraceTokenizer(path or shared_path("tokenizers", "gpt2", "tokenizer.json"))


def _token_ids(value, what: str, where: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(type(t) is int and t >= 0 for t in value):
        raise TraceError(f"{where}: {what} must be a non-empty list of token ids (ints >= 0)")
    return value


def _recorded(obj: dict, where: str, eos_id: int) -> tuple[list[int], list[tuple[str, list[int]]]]:
    """(prompt ids, [(completion text, ids ending with EOS)]) of a recorded line."""
    prompt = _token_ids(obj.get("prompt_ids"), "prompt_ids", where)
    comps = obj.get("completion_ids")
    if not isinstance(comps, list):
        raise TraceError(f"{where}: completion_ids must be a list of token-id lists")
    texts = obj.get("completions")
    if texts is not None and (not isinstance(texts, list) or len(texts) != len(comps)):
        raise TraceError(f"{where}: {len(comps)} completion_ids but "
                         f"{len(texts) if isinstance(texts, list) else 'no list of'} completions")
    meta = obj.get("meta") if isinstance(obj.get("meta"), dict) else {}
    eos = meta.get("eos_token_id", eos_id)
    if type(eos) is not int:
        raise TraceError(f"{where}: meta.eos_token_id must be an int, got {eos!r}")
    out = []
    for k, ids in enumerate(comps):
        text = texts[k] if texts is not None else None
        if texts is not None and not (isinstance(text, str) and text) or ids == []:
            continue  # an empty sample, left out as text traces leave it (answers stay aligned)
        ids = _token_ids(ids, f"completion_ids[{k}]", where)
        out.append((text, ids if ids[-1] == eos else ids + [eos]))
    return prompt, out


def load_problems(path: str, tokenizer=None, eos_id: int = GPT2_EOS, limit: int | None = None,
                  min_samples: int = 2, log=None, skip_bad: bool = False) -> list[Problem]:
    """Tokenized problems from a trace file (:class:`TraceLines`: a bad line
    is an error unless ``skip_bad``).  Entries with too few samples or no
    prompt are skipped and reported through ``log``; recorded ids that are
    malformed are a :class:`TraceError` naming the line.  ``tokenizer``
    (``encode_batch``) is used for text-only lines; ``eos_id`` ends their
    completions (recorded lines end with their own ``meta.eos_token_id``)."""
    lines = TraceLines(path, skip_bad)
    problems: list[Problem] = []
    few = f"fewer than {min_samples} non-empty completions"
    for lineno, obj in lines:
        if limit is not None and len(problems) >= limit:
            break
        where = f"{path}, line {lineno}"
        pid = trace_id(obj, lineno)
        if "prompt_ids" in obj or "completion_ids" in obj:
            prompt_ids, recorded = _recorded(obj, where, eos_id)
            if len(recorded) < min_samples:
                lines.skip(few)
                continue
            if isinstance(tokenizer, TraceTokenizer):
                pairs = [(t, ids[:-1]) for t, ids in recorded if t is not None]
                tokenizer.remember([t for t, _ in pairs], [ids for _, ids in pairs])
            problems.append(Problem(pid, prompt_ids, [ids for _, ids in recorded]))
            continue
        prompt, comps = obj.get("prompt"), completion_texts(obj)
        if not isinstance(prompt, str) or not prompt or not isinstance(obj.get("completions"), list):
            lines.skip("no prompt or completions")
            continue
        if len(comps) < min_samples:
            lines.skip(few)
            continue
        if tokenizer is None:
            raise TraceError(f"{where}: text without token ids, and no tokenizer given")
        encoded = tokenizer.encode_batch([prompt] + comps)
        problems.append(Problem(pid, encoded[0].ids, [e.ids + [eos_id] for e in encoded[1:]]))
    lines.report(log)
    if not problems:
        raise TraceError(f"{path}: no replayable problems (need a prompt and >= {min_samples} completions)")
    return problems
