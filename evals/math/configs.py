"""``python -m evals math`` settings: ``--waves`` schedules and the
configurations they make with ``--early-stop`` rules
(:func:`evals.options.parse_early_stop`)."""

from __future__ import annotations

import argparse
import sys

from ..options import UsageError

# tokens per sample when --max-tokens is not given, by problem kind
DEFAULT_MAX_TOKENS = {"synthetic": 256, "math": 1024}


def max_tokens(args, problems) -> int:
    """``--max-tokens``, else the default for the problems' kind."""
    kind = "synthetic" if all(p.kind == "synthetic" for p in problems) else "math"
    return args.max_tokens or DEFAULT_MAX_TOKENS[kind]


class Parser(argparse.ArgumentParser):
    """``math`` and ``record`` parse with this: a bad argument is a UsageError."""

    def error(self, message):  # one line instead of usage + message
        raise UsageError(message)


def early_stop_label(rule) -> str:
    return "off" if rule is None else rule.describe()


def parse_waves(values: list[str] | None) -> list:
    """``--waves`` values -> list of "auto" or :class:`Schedule` (its waves and
    ``fill_idle``; capacity and check come from their own flags)."""
    from consensus_spec.sampling.waves import Schedule

    out = []
    for v in values or ["auto"]:
        if v.strip().lower() == "auto":
            out.append("auto")
            continue
        try:
            out.append(Schedule.parse(v))
        except ValueError as e:
            raise UsageError(f"--waves expects auto, all or sizes like 4,4,rest (+no-fill): {v!r} ({e})")
    return list(dict.fromkeys(out))


def build_configs(args) -> list[tuple]:
    """(n, Schedule, StopRule or None) for every --n x --waves x --early-stop,
    without duplicates; all-at-once with a whole-wave check could never stop,
    so that combination is skipped."""
    from consensus_spec.sampling.options import resolve_schedule
    from consensus_spec.sampling.waves import Schedule

    configs, skipped = [], []
    for n in args.n:
        for waves in args.waves:
            for rule in args.early_stop:
                fill = True
                if waves == "auto":
                    waves_here = resolve_schedule(None, rule).waves  # the library's default
                else:
                    waves_here, fill = waves.waves, waves.fill_idle
                check = args.check if rule is not None else "index"  # no rule: no check at all
                schedule = Schedule(waves=waves_here, capacity=args.capacity, check=check, fill_idle=fill)
                if rule is not None and check == "wave" and len(schedule.sizes(n)) < 2:
                    skipped.append(f"waves {schedule.describe()} with early stop "
                                   f"{rule.describe()} at n={n}")
                    continue
                if (n, schedule, rule) not in configs:
                    configs.append((n, schedule, rule))
    if not configs:
        raise UsageError(f"no configuration left to run: {skipped[0]} is one wave, so whole-wave "
                         "checks never stop (use --check index or more waves)")
    for text in skipped:
        print(f"note: skipping {text}: one wave, nothing to stop", file=sys.stderr)
    return configs
