"""The consensus proposer's drafts on recorded fixtures, one digest per
propose() call: what ``tests/test_drafts_unchanged.py`` holds the current
code to. Recorded with earlier code, imported beside this one from git
(``evals/measure/previous.py``): ``CONFIGS`` with main before issue 50
merged (2df8630: the code before issue 43, the per-step host time work,
drafted the same but for the guard's change of ab012eb, which alters the
two budget configurations from call 77), ``LONG_PROMPT_CONFIGS`` (the
workloads of issue 50: long prompts with short answers, n=64) with the
code before issue 50 (2df8630 drafts the same there):

    python -m tests.draft_fixture --previous 2df8630 --out tests/fixtures/drafts_2df8630.json
    python -m tests.draft_fixture --previous 440a09e --configs long_prompts \
        --out tests/fixtures/drafts_440a09e.json

The long-prompt fixtures are the first problems of traces recorded with
``python -m evals record`` (docs/host_time.md says how), cut to a few
paths and tokens: the embedded model's prompts of 440-476 tokens (16
paths, 32 tokens each) and of 250-420 tokens (64 paths, 48 tokens each),
and SmolLM2-135M's 8-shot GSM8K prompts of 1,430 tokens (16 paths, 32
tokens each).

A small engine drives the proposer as vLLM's runner would: rows admitted as
rows free up, drafts verified against the recorded tokens, finished rows
condensed (the last row moves into the hole), and, per configuration,
preempted rows that resume later and steps with no propose call. Time is a
fixed model (``Clock``), so the online budget learns the same thing in
every run and its choices are part of what is compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from types import SimpleNamespace

import numpy as np

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
TRACES = os.path.join(FIXTURES, "embedded_n8.jsonl")
FEWSHOT = os.path.join(FIXTURES, "embedded_fewshot_n16.jsonl")
LONG_N64 = os.path.join(FIXTURES, "embedded_long_n64.jsonl")
FEWSHOT_1430 = os.path.join(FIXTURES, "smollm2_fewshot_n16.jsonl")
K = 6

# name: (rows, proposer options, preempt every N steps, skip a propose call every N steps)
CONFIGS = {
    "rows8_budget": (8, {}, 0, 0),
    "rows3_budget": (3, {}, 0, 0),
    "rows32_nobudget": (32, {"cost_model": "off"}, 0, 0),
    "rows16_preempt_skip": (16, {}, 11, 13),
    # a small arena: halves rotate, live groups lose their tries, the cross trie restarts
    "rows16_small_arena": (16, {"cost_model": "off", "max_trie_nodes": 6000,
                                "cross_group_tokens": 800, "max_group_tokens": 3000,
                                "prompt_tokens": 64}, 0, 0),
}
# name: (traces, rows, proposer options, preempt every N steps, skip every N steps)
LONG_PROMPT_CONFIGS = {
    "fewshot_rows16_budget": ("fewshot", 16, {}, 0, 0),
    "fewshot_rows48_preempt_skip": ("fewshot", 48, {}, 7, 11),
    # whole prompts indexed (prompt_tokens past twice their length); groups
    # forgotten while their paths run; halves rotating under prompt builds
    "fewshot_rows32_small_arena": ("fewshot", 32, {"cost_model": "off", "max_trie_nodes": 40_000,
                                                   "prompt_tokens": 1024, "max_group_tokens": 2000,
                                                   "cross_group_tokens": 3000}, 0, 0),
    "long64_rows64_budget": ("long64", 64, {}, 0, 0),
    "long64_rows128_nobudget": ("long64", 128, {"cost_model": "off"}, 5, 0),
    # 8-shot prompts of 1,430 tokens: every group indexes a 512-token tail
    "fewshot1430_rows32_budget": ("fewshot1430", 32, {}, 0, 0),
    "fewshot1430_rows16_small_arena": ("fewshot1430", 16, {"cost_model": "off",
                                                           "max_trie_nodes": 30_000}, 0, 0),
}
TRACE_FILES = {"embedded_n8": TRACES, "fewshot": FEWSHOT, "long64": LONG_N64,
               "fewshot1430": FEWSHOT_1430}


def load_problems(path: str = TRACES) -> list[tuple[list[int], list[list[int]]]]:
    with open(path, encoding="utf-8") as f:
        return [(obj["prompt_ids"], obj["completion_ids"]) for obj in map(json.loads, f)]


class Clock:
    """Seconds: each read advances 10 µs (the proposer's own time), each
    verified step a fixed model of rows and draft tokens."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-5
        return self.now

    def step(self, rows: int, drafted: int) -> None:
        self.now += (2.0 + 0.05 * rows + 0.08 * drafted) / 1000.0


def digest(drafts) -> str:
    return hashlib.sha1(repr([list(map(int, d)) for d in drafts]).encode()).hexdigest()[:12]


def drive(package, rows: int, options: dict, preempt: int = 0, skip: int = 0,
          counters: dict | None = None, traces: str = TRACES) -> list[str]:
    """One digest per propose() call of ``package``'s proposer (a
    ``consensus_spec`` module) over the fixture ``traces`` at ``rows``
    rows; ``counters`` gets the proposer's counters at the end."""
    problems = load_problems(traces)
    max_len = max(len(p) + max(map(len, c)) for p, c in problems) + K + 2
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=K),
                          model_config=SimpleNamespace(max_model_len=max_len + 8),
                          scheduler_config=SimpleNamespace(max_num_seqs=rows), additional_config={})
    proposer = package.ConsensusProposer(cfg, remember_costs=False, **options)
    clock = proposer.clock = Clock()
    buf = np.zeros((rows, max_len), np.int32)
    num = np.zeros(rows, np.int32)
    queue = [(p, s) for p in range(len(problems)) for s in range(len(problems[p][1]))]
    batch: list[list] = []  # [seq, n, sampled]
    waiting: list[tuple[int, list]] = []  # (step it resumes at, row) of preempted rows
    out, step = [], 0
    while queue or batch or waiting:
        step += 1
        for entry in [w for w in waiting if w[0] <= step][:rows - len(batch)]:
            waiting.remove(entry)
            row = entry[1]
            row[1] += 1  # its resumed prefill samples the next token
            row[2] = [row[0][row[1] - 1]]
            batch.append(row)
        while len(batch) < rows and queue:
            p, s = queue.pop(0)
            seq = problems[p][0] + problems[p][1][s]
            n = len(problems[p][0]) + 1
            batch.append([seq, n, [seq[n - 1]]])
        if preempt and step % preempt == 0 and len(batch) > 2:
            waiting.append((step + 3, batch.pop(len(batch) // 2)))  # later rows move up
        for i, (seq, n, _) in enumerate(batch):
            buf[i, :n] = seq[:n]
            num[i] = n
        if skip and step % skip == 0:  # vLLM runs the step without calling the drafter
            drafts = [[] for _ in batch]
        else:
            drafts = proposer.propose([r[2] for r in batch], num, buf)
            out.append(digest(drafts))
        drafted = 0
        for row, draft in zip(batch, drafts):
            seq, n = row[0], row[1]
            draft = list(draft)[:K]
            acc = 0
            while acc < len(draft) and n + acc < len(seq) and draft[acc] == seq[n + acc]:
                acc += 1
            row[2] = seq[n:n + acc + 1]
            row[1] = n + len(row[2])
            drafted += len(draft)
        clock.step(len(batch), drafted)
        # vLLM's condense: the last live row moves into each hole a finished one left
        holes = [i for i, r in enumerate(batch) if r[1] >= len(r[0])]
        last = len(batch) - 1
        for hole in holes:
            while last > hole and batch[last][1] >= len(batch[last][0]):
                last -= 1
            if last <= hole:
                break
            batch[hole], batch[last] = batch[last], batch[hole]
            last -= 1
        del batch[len(batch) - len(holes):]
    if proposer.num_failures:
        raise RuntimeError(f"{proposer.num_failures} propose() calls failed")
    if counters is not None:
        counters.update(proposer.counters())
    return out


def drive_config(package, name: str, counters: dict | None = None) -> list[str]:
    """:func:`drive` of one configuration of ``CONFIGS`` or ``LONG_PROMPT_CONFIGS``."""
    if name in CONFIGS:
        return drive(package, *CONFIGS[name], counters=counters)
    traces, *config = LONG_PROMPT_CONFIGS[name]
    return drive(package, *config, counters=counters, traces=TRACE_FILES[traces])


def record(package, configs: dict) -> dict:
    return {name: drive_config(package, name) for name in configs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.draft_fixture",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--previous", required=True,
                    help="git revision whose consensus_spec records the drafts")
    ap.add_argument("--configs", choices=("first", "long_prompts"), default="first",
                    help="CONFIGS (first) or LONG_PROMPT_CONFIGS")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    configs = CONFIGS if args.configs == "first" else LONG_PROMPT_CONFIGS
    sys.path.insert(0, os.path.dirname(FIXTURES.rsplit(os.sep, 1)[0]))
    from evals.measure.previous import load

    package = load(args.previous)
    data = {"recorded_with": package.__name__, "k": K,
            "configs": {n: list(c) for n, c in configs.items()}, "digests": record(package, configs)}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out}: "
          + ", ".join(f"{n} {len(d)} calls" for n, d in data["digests"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
