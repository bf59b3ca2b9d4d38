"""Math evaluation sets for ``python -m evals math``.

A dataset is a name (``gsm8k``, ``math500``, ``aime2024``, ``synthetic``) or a
local ``.jsonl``/``.json``/``.parquet`` file.  Names read the shared copy in
``../shared/data/math/`` when present, else the Hugging Face hub (needs
internet).  ``synthetic`` is the embedded model's held-out set
(:func:`consensus_spec.model.synthetic.test_set`).

Every problem comes back as a :class:`MathProblem` with the question text and
the gold final answer as a string (GSM8K: the text after ``####``), plus its
canonical key from :func:`consensus_spec.voting.answers.normalize_answer`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from consensus_spec.voting.answers import extract_answer, normalize_answer

from ..traces import shared_path

SHARED_MATH = shared_path("math")

# name -> (shared file, hub id, hub config, hub split)
HUB = {
    "gsm8k": ("gsm8k_test.jsonl", "openai/gsm8k", "main", "test"),
    "math500": ("math500_test.jsonl", "HuggingFaceH4/MATH-500", None, "test"),
    "aime2024": ("aime2024_test.jsonl", "HuggingFaceH4/aime_2024", None, "train"),
}
NAMES = (*HUB, "synthetic")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")

QUESTION_FIELDS = ("question", "problem", "prompt", "input", "query")
ANSWER_FIELDS = ("answer", "final_answer", "gold", "target", "label", "solution", "output")


class DatasetError(ValueError):
    """A dataset that cannot be loaded (message is one line, for the CLI)."""


@dataclass
class MathProblem:
    id: str
    question: str
    gold: str  # final answer text, e.g. "18" or "\\frac{14}{3}"
    kind: str = "math"  # "math" (boxed-answer prompt) or "synthetic" (its own format)

    @property
    def gold_key(self) -> str:
        return normalize_answer(self.gold)


def gold_answer(value, field: str = "answer") -> str | None:
    """Final gold answer from a dataset field.

    GSM8K-style text keeps what follows the last ``####``; a full solution
    (``solution``/``output`` fields, or text with ``\\boxed{}``) gives its
    extracted final answer; anything else is the answer itself.
    """
    if value is None:
        return None
    if isinstance(value, int):  # bool included
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    text = str(value).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
        return text.replace(",", "") if text.replace(",", "").lstrip("-").isdigit() else text
    if field in ("solution", "output") or "\\boxed" in text or "\\fbox" in text:
        return extract_answer(text)
    return text or None


def resolve(spec: str) -> tuple[str, str | None]:
    """(kind, path): kind is a dataset name or "file"; path is the local file
    to read, or None for synthetic / hub datasets.  Raises DatasetError."""
    key = spec.lower()
    if key == "synthetic":
        return "synthetic", None
    if key in HUB:
        path = os.path.join(SHARED_MATH, HUB[key][0])
        return key, (path if os.path.exists(path) else None)
    if key.endswith(FILE_SUFFIXES) or os.sep in spec or os.path.exists(spec):  # a file
        if not os.path.isfile(spec):
            raise DatasetError(f"dataset file not found: {spec}")
        if not key.endswith(FILE_SUFFIXES):
            raise DatasetError(f"unsupported dataset file {spec!r} (use .jsonl, .json or .parquet)")
        return "file", spec
    raise DatasetError(f"unknown dataset {spec!r}: use one of {', '.join(NAMES)} "
                       "or a .jsonl/.json/.parquet file")


def load_problems(spec: str, limit: int | None = None) -> list[MathProblem]:
    """Problems of dataset ``spec`` (name or file), the first ``limit`` of them."""
    kind, path = resolve(spec)
    if kind == "synthetic":
        from consensus_spec.model.synthetic import test_set

        rows = test_set(n=limit or 500)
        return [MathProblem(f"synthetic-{i}", r["question"], str(r["answer"]), "synthetic")
                for i, r in enumerate(rows)]
    rows = _read_rows(path) if path else _read_hub(kind)
    problems = [_problem(row, i, spec) for i, row in enumerate(rows[:limit])]
    if not problems:
        raise DatasetError(f"dataset {spec!r} has no problems")
    return problems


def _problem(row: dict, i: int, spec: str) -> MathProblem:
    q_field = next((f for f in QUESTION_FIELDS if row.get(f) not in (None, "")), None)
    a_field = next((f for f in ANSWER_FIELDS if row.get(f) not in (None, "")), None)
    if q_field is None or a_field is None:
        raise DatasetError(
            f"{spec}: row {i} needs a question field ({'/'.join(QUESTION_FIELDS)}) and an answer "
            f"field ({'/'.join(ANSWER_FIELDS)}); it has {sorted(row)}")
    gold = gold_answer(row[a_field], a_field)
    if gold is None:
        raise DatasetError(f"{spec}: row {i} has no usable gold answer in {a_field!r}")
    pid = row.get("id", row.get("unique_id", i))
    return MathProblem(str(pid), str(row[q_field]), gold)


def _read_rows(path: str) -> list[dict]:
    try:
        from datasets import load_dataset
    except ImportError:
        return _read_rows_plain(path)
    builder = "parquet" if path.lower().endswith(".parquet") else "json"
    try:
        ds = load_dataset(builder, data_files=path, split="train")
    except Exception as e:  # noqa: BLE001 - malformed file: one-line message
        raise DatasetError(f"cannot read {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return list(ds)


def _read_rows_plain(path: str) -> list[dict]:
    """Fallback without the ``datasets`` package (json/jsonl only)."""
    import json

    if path.lower().endswith(".parquet"):
        raise DatasetError("reading .parquet needs the datasets package (pip install datasets)")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        if path.lower().endswith(".jsonl"):
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"cannot read {path}: {e}")
    return data if isinstance(data, list) else data.get("data", [])


def _read_hub(name: str) -> list[dict]:
    _, hub_id, config, split = HUB[name]
    try:
        from datasets import load_dataset

        ds = load_dataset(hub_id, config, split=split)
    except Exception as e:  # noqa: BLE001 - offline, missing package...
        raise DatasetError(
            f"{name}: no local copy in {SHARED_MATH} and loading {hub_id} from the Hugging Face "
            f"hub failed ({type(e).__name__}); pass a local .jsonl file instead")
    return list(ds)
