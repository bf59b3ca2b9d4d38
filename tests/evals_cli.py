"""The evals tools as a user runs them: ``python -m evals <command> ...`` in a
subprocess from the repository root, on small fixtures the tests write.
No test imports the evals package: its command line is its interface."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
# 16 synthetic problems x 8 samples of the embedded model, recorded with
#   python -m evals record --out tests/fixtures/embedded_n8.jsonl --dataset synthetic --limit 16
#       --n 8 --max-tokens 96 --temperature 0.8 --dtype float32 --max-model-len 512 --seed 0
TRACES = os.path.join(FIXTURES, "embedded_n8.jsonl")
# COST_MODELS["h200_7b"].step_ms at B 1..128, q 1..17, rounded (the budget's own H200 model,
# standing in for ../shared/data/costs; tests/test_budget.py says how it was made)
STEP_COSTS = os.path.join(FIXTURES, "step_costs.jsonl")
EOS = 2  # the end token of the trace files tests write


def run_evals(*args, timeout=600, env=None, cwd=REPO):
    """``python -m evals ARGS``; ``env``: variables added to this process's."""
    full_env = None if env is None else {**os.environ, **env}
    return subprocess.run([sys.executable, "-m", "evals", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=full_env)


def ok(out) -> str:
    """stdout of a command that must have succeeded."""
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def write_traces(path, problems, texts=None, eos=EOS) -> str:
    """A recorded trace file (the format ``python -m evals record`` writes):
    ``problems`` is ``[(id, prompt ids, [completion ids, ...]), ...]``; each
    completion ends with ``eos`` (added where missing).  ``texts``, if given:
    per problem, the completions' texts (what answer-based replays vote on)."""
    lines = []
    for i, (pid, prompt, comps) in enumerate(problems):
        obj = {"id": pid, "prompt": f"problem {pid}", "prompt_ids": list(prompt),
               "completion_ids": [list(c) if c[-1] == eos else list(c) + [eos] for c in comps],
               "meta": {"eos_token_id": eos}}
        obj["completions"] = list(texts[i]) if texts is not None else [f"path {k}" for k in range(len(comps))]
        lines.append(json.dumps(obj))
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def paths(problems) -> int:
    return sum(len(comps) for _, _, comps in problems)


def recorded_tokens(problems) -> int:
    """Tokens a replay produces: every recorded token (EOS included) but each
    path's first, which comes from prefill."""
    return sum(len(c) + (c[-1] != EOS) - 1 for _, _, comps in problems for c in comps)


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def char_tokenizer(path) -> str:
    """A tokenizer.json that gives each character its code point (what text
    traces are tokenized with when a test passes ``--tokenizer``)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({chr(i): i for i in range(32, 127)}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.save(str(path))
    return str(path)


def synthetic_problems(n_problems=4, n_samples=6):
    """Siblings sharing a prefix, with one of three endings."""
    out = []
    for p in range(n_problems):
        base = [30 + p, 31, 32, 33, 34, 35, 36, 37]
        comps = [base + ([40 + (s % 2), 42, 43, 44] if s % 3 else [50, 51]) + [EOS] for s in range(n_samples)]
        out.append((f"p{p}", [1000 + p] + list(range(10, 20)), comps))
    return out
