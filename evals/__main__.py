"""``python -m evals <command>``: replay benchmark and math evals."""

from __future__ import annotations

import sys

COMMANDS = {
    "replay": ("evals.replay_bench", "replay recorded traces through the drafters"),
    "math": ("evals.math_eval", "self-consistency math eval: accuracy and speed per drafting method"),
    "step-costs": ("evals.step_costs", "measure a step-cost table T(B, q) for the draft budget"),
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
