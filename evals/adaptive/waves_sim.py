"""Simulate wave schedules and stop rules on a plain run's samples.

    python -m evals waves-sim RESULTS.json [--waves 4,4,rest 1,2,4,rest ...]
                              [--rules on decided ...] [--capacity 256] [--perms 5]

For each wave schedule x stop rule, drives the real
:class:`~consensus_spec.sampling.waves.PathPlanner` over the samples of the
plain rows (all n at once, no early stop) of a ``python -m evals math`` JSON,
one token per path per engine step, with the embedded model's CPU step-cost
model (``budget.COST_MODELS["cpu_embedded"]``).  Reports tokens, estimated
wall time and engine steps relative to all-at-once, batch fill, agreement
with the plain run's full-n answer and maj@n, over ``--perms`` path orders
(the first as recorded).  This is how the default waves were chosen (see
:class:`consensus_spec.sampling.waves.Schedule`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys

from ..options import parse_early_stop
from .vote_traces import answer_classes, path_planner, winner


def simulate(problems, schedule, rule, cost) -> dict:
    """problems: list of (class ids, tokens, correct-per-class, full winner)."""
    plan = path_planner(len(problems), len(problems[0][0]), schedule, rule)
    running: dict[tuple[int, int], int] = {}  # (problem, path): tokens still to generate
    ms = steps = tokens = 0.0

    def submit(paths):
        for p, k in paths:
            running[(p, k)] = max(1, problems[p][1][k])

    submit(plan.admit())
    while running:
        steps += 1
        tokens += len(running)  # one token per running path
        ms += float(cost.step_ms(len(running), 1))
        for key in list(running):
            running[key] -= 1
        for key in [k for k, left in running.items() if left == 0]:
            if key not in running:  # aborted by a stop earlier in this step
                continue
            del running[key]
            p, k = key
            to_submit, to_abort = plan.on_finish(p, k, problems[p][0][k])
            for a in to_abort:
                running.pop(a, None)
            submit(to_submit)
    agree = correct = 0
    for p, (ids, _, right, full) in enumerate(problems):
        voted = winner([ids[k] for k in sorted(plan.problems[p].paths)])  # ties: lowest path, as voted
        agree += voted == full
        correct += voted is not None and right[voted]
    return dict(tokens=tokens, ms=ms, steps=steps, fill=tokens / steps / schedule.capacity,
                agreement=agree / len(problems), maj=correct / len(problems))


def load(path: str) -> dict[str, list]:
    """Per plain row of a math run: answer_classes (class ids, tokens, correct per class)."""
    with open(path) as f:
        data = json.load(f)
    return {f"{row['method']} n={row['n']}": answer_classes(row) for row in data["results"]
            if (row.get("waves"), row.get("early_stop")) == ("all", "off")}


def main(argv=None) -> int:
    from consensus_spec.budget import COST_MODELS
    from consensus_spec.sampling.waves import Schedule

    ap = argparse.ArgumentParser(prog="python -m evals waves-sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="JSON written by python -m evals math (with a plain row)")
    ap.add_argument("--waves", nargs="+", default=["1,2,4,rest", "2,2,4,rest", "3,4,rest", "4,rest",
                                                    "4,4,rest", "4,2,2,rest", "4,4,4,rest", "4"])
    ap.add_argument("--rules", nargs="+", default=["on"])
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--perms", type=int, default=5, help="random path orders (first: recorded)")
    args = ap.parse_args(argv)
    cost = COST_MODELS["cpu_embedded"]
    rules = parse_early_stop(args.rules)
    for name, problems in load(args.results).items():
        print(f"\n{name}: {len(problems)} problems, capacity {args.capacity}, {args.perms} orders\n")
        print("| waves | rule | tokens % | est. wall % | steps % | batch fill | agree % (worst) | "
              "maj@n (full-n) |\n|---|---|---|---|---|---|---|---|")
        rng = random.Random(0)
        orders = []
        for r in range(args.perms):
            perm = []
            for ids, toks, right in problems:
                idx = list(range(len(ids)))
                if r:
                    rng.shuffle(idx)
                ids_here = [ids[i] for i in idx]  # full-n winner in this path order (ties: lowest path)
                perm.append((ids_here, [toks[i] for i in idx], right, winner(ids_here)))
            orders.append(perm)
        base = [simulate(o, Schedule(waves=("rest",), capacity=args.capacity), None, cost)
                for o in orders]
        full_maj = base[0]["maj"]
        for spec in args.waves:
            schedule = Schedule.parse(spec, capacity=args.capacity)
            for rule in rules:
                res = [simulate(o, schedule, rule, cost) for o in orders]

                def mean(key, rel=False):
                    vals = [r[key] / b[key] if rel else r[key] for r, b in zip(res, base)]
                    return sum(vals) / len(vals)

                print(f"| {schedule.describe()} | {rule.describe()} | {100 * mean('tokens', True):.1f} | "
                      f"{100 * mean('ms', True):.1f} | {100 * mean('steps', True):.1f} | "
                      f"{mean('fill'):.3f} | {100 * mean('agreement'):.1f} "
                      f"({100 * min(r['agreement'] for r in res):.1f}) | {mean('maj'):.3f} "
                      f"({full_maj:.3f}) |")
        sys.stdout.flush()
    return 0
