"""``python -m evals math`` settings: ``--early-stop`` rules, ``--waves``
schedules, and the configurations they make."""

from __future__ import annotations

import argparse
import sys

# tokens per sample when --max-tokens is not given, by problem kind
DEFAULT_MAX_TOKENS = {"synthetic": 256, "math": 1024}


def max_tokens(args, problems) -> int:
    """``--max-tokens``, else the default for the problems' kind."""
    kind = "synthetic" if all(p.kind == "synthetic" for p in problems) else "math"
    return args.max_tokens or DEFAULT_MAX_TOKENS[kind]


class UsageError(Exception):
    """Bad command line: reported as one ``error:`` line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """``math`` and ``record`` parse with this: a bad argument is a UsageError."""

    def error(self, message):  # one line instead of usage + message
        raise UsageError(message)


RULE_PARAMS = {"bayes": ("error", float), "sequential": ("error", float), "predictive": ("error", float),
               "beta": ("error", float), "adaptive": ("error", float), "window": ("window", int),
               "esc": ("window", int), "margin": ("margin", int)}


def parse_early_stop(values: list[str] | None) -> list:
    """``--early-stop`` values -> list of StopRule (None: off)."""
    from consensus_spec.sampling.engine_loop import resolve_stop_rule
    from consensus_spec.sampling.stopping import KINDS, StopRule

    if values is None:
        return [None]
    if not values:  # bare flag
        return [StopRule()]
    out = []
    for v in values:
        text = v.strip().lower()
        text, plus, flag = text.partition("+")
        if plus and flag != "forecast":
            raise UsageError(f"--early-stop: the one suffix is +forecast (bayes rules), got {v!r}")
        kind, _, value = text.partition(":")
        try:
            if plus:  # the rule, then its forecast (errors below name the rule)
                rule = parse_early_stop([text])[0]
                if rule is None or rule.kind != "bayes":
                    raise UsageError(f"--early-stop: +forecast goes with the bayes rule (on, bayes[:ERROR]), "
                                     f"got {v!r}")
                out.append(rule.with_overrides(forecast=True))
            elif text in ("off", "none", "no", "false"):
                out.append(None)
            elif text in ("on", "true", "yes", "default"):
                out.append(StopRule())
            elif kind in KINDS and (not value or kind in RULE_PARAMS):
                rule = StopRule(kind=kind)
                if value:
                    field, cast = RULE_PARAMS[kind]
                    rule = rule.with_overrides(**{field: cast(value)})
                out.append(rule)
            else:
                out.append(resolve_stop_rule(float(text)))  # a margin, as before
        except ValueError as e:
            raise UsageError(f"--early-stop expects off, on, decided, KIND[:VALUE] "
                             f"(kinds {', '.join(KINDS)}) or a margin > 0, got {v!r}"
                             + (f" ({e})" if "StopRule" in str(e) else ""))
    return list(dict.fromkeys(out))


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
    from consensus_spec.sampling.waves import REST, Schedule

    configs, skipped = [], []
    for n in args.n:
        for waves in args.waves:
            for rule in args.early_stop:
                fill = True
                if waves == "auto":
                    waves_here = Schedule().waves if rule is not None else (REST,)
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
