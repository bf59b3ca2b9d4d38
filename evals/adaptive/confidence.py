"""DeepConf-style trace confidence on recorded traces with logprobs.

    python -m evals confidence --traces FILE ... [--window 16] [--keep 0.1 0.5 0.9]
                               [--perms 5] [--out results/confidence]

Traces recorded with ``python -m evals record`` carry each path's token
logprobs (the sampled token's) and the gold answer.  Per set, side by side:

* **filtered votes** (DeepConf offline): the plain majority of the ``keep``
  share of paths with the highest lowest-window confidence
  (:func:`~consensus_spec.voting.confidence.confident_paths`), and the same
  weighted by exp(confidence) (the worst window's geometric-mean token
  probability);
* **ended paths** (DeepConf online, the threshold learned from the run): a
  path ends as soon as its last ``window`` tokens' mean falls below the
  (1 - keep) quantile of the confidences of the paths finished in earlier
  problems of the run (none for the first problem); an ended path does not
  vote and costs the tokens it wrote.  Alone and under the default stop rule
  (``bayes``, a look after every path in path order, ``--perms`` seeded
  orders), against the same rule with every path run to its end.

Reported: share of the tokens, gold accuracy, and agreement with the vote
of all paths (a tie in it: any of its leaders agrees).  An ended path's
worst window so far joins the run's history, so the threshold does not
drift up on the survivors.  Sets without logprobs are reported and left out.
"""

from __future__ import annotations

import argparse
import random
import sys

import numpy as np

from consensus_spec.sampling.stopping import StopRule, should_stop_ids, tally
from consensus_spec.voting.answers import extract_answer
from consensus_spec.voting.confidence import (DEFAULT_WINDOW, RunningConfidence, confidence_weights,
                                              confident_paths, trace_confidence)

from ..options import add_skip_bad_arg, fail, write_results
from ..traces import TraceError, TraceLines
from .vote_traces import gold_classes, winner


def load(path: str, skip_bad: bool = False) -> list[dict]:
    """Problems with per-path answers, class ids, gold correctness, logprobs
    (:class:`~evals.traces.TraceLines`: a bad line is an error unless ``skip_bad``)."""
    lines, out = TraceLines(path, skip_bad), []
    for _, obj in lines:
        comps, lps = obj.get("completions"), obj.get("logprobs")
        if not isinstance(comps, list) or not isinstance(lps, list) or len(lps) != len(comps) \
                or len(comps) < 2 or not all(isinstance(x, list) and x for x in lps):
            lines.skip("no logprobs for each of 2 or more completions")
            continue
        answers = obj.get("answers") or [extract_answer(c) for c in comps]
        ids, correct = gold_classes(answers, obj.get("gold", obj.get("answer")))
        out.append(dict(ids=ids, correct=correct, logprobs=lps, tokens=[len(x) for x in lps]))
    lines.report()
    return out


def leaders(ids) -> frozenset:
    """The full vote's leaders (a tie: every tied class agrees with it)."""
    ranked = tally(ids)
    return frozenset(c for c, v in ranked if v == ranked[0][1]) if ranked else frozenset({None})


def right(problem, cls) -> bool:
    return cls is not None and problem["correct"] is not None and problem["correct"][cls]


def weighted_winner(ids, weights):
    score: dict[int, float] = {}
    for i, w in zip(ids, weights):
        if i is not None and w > 0:
            score[i] = score.get(i, 0.0) + w
    return max(score, key=score.get) if score else None  # dicts keep first-seen order for ties


def offline(problems, keep: float, window: int) -> dict:
    acc = agree = acc_w = agree_w = 0
    for prob in problems:
        conf = [trace_confidence(lp, window) for lp in prob["logprobs"]]
        kept = confident_paths(conf, keep)
        full = leaders(prob["ids"])
        got = winner([prob["ids"][k] for k in kept])
        got_w = weighted_winner(prob["ids"], confidence_weights(prob["logprobs"], keep, window))
        acc += right(prob, got)
        agree += got in full
        acc_w += right(prob, got_w)
        agree_w += got_w in full
    n = len(problems)
    return dict(acc=acc / n, agree=agree / n, acc_w=acc_w / n, agree_w=agree_w / n)


def online(problems, keep: float | None, window: int, rule: StopRule | None, order_seed: int) -> dict:
    """One run over the problems in file order; ``keep`` None: no path ends early."""
    rng = random.Random(order_seed)
    history: list[float] = []  # trace confidences of earlier problems' finished paths
    tokens = total = acc = agree = ended = 0
    for prob in problems:
        n = len(prob["ids"])
        order = list(range(n))
        if order_seed:
            rng.shuffle(order)
        threshold = float(np.quantile(history, 1.0 - keep)) if keep is not None and history else -np.inf
        votes: list[int | None] = []
        for j, k in enumerate(order):
            lps = prob["logprobs"][k]
            run = RunningConfidence(window, threshold)
            used, low = len(lps), None
            for t, lp in enumerate(lps):
                run.add(lp)
                if run.low():
                    used, low = t + 1, run.current
                    break
            tokens += used
            if low is not None:  # ended: no vote; its worst window so far joins the history
                ended += 1
                votes.append(None)
                history.append(min(low, trace_confidence(lps[:used], window)))
            else:
                votes.append(prob["ids"][k])
                history.append(trace_confidence(lps, window))
            if rule is not None and should_stop_ids(votes, n - j - 1, rule):
                break
        total += sum(prob["tokens"])
        got = winner(votes)
        acc += right(prob, got)
        agree += got in leaders(prob["ids"])
    n = len(problems)
    return dict(tokens=tokens / total, acc=acc / n, agree=agree / n, ended=ended)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals confidence", description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", required=True, help="JSONL traces with logprobs (evals record)")
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    ap.add_argument("--keep", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--perms", type=int, default=5, help="path orders for the stop-rule runs")
    ap.add_argument("--out", default="results/confidence")
    add_skip_bad_arg(ap)
    args = ap.parse_args(argv)
    if args.window < 1 or args.perms < 1 or not all(0 < k <= 1 for k in args.keep):
        ap.error("--window and --perms must be >= 1, --keep shares in (0, 1]")
    lines, rows = [], []
    for path in args.traces:
        try:
            problems = load(path, args.skip_bad_lines)
        except (OSError, TraceError) as e:
            return fail(e)
        name = path.rsplit("/", 1)[-1].removesuffix(".jsonl")
        if not problems:
            print(f"{name}: no problems with per-path logprobs: left out", file=sys.stderr)
            continue
        n = len(problems[0]["ids"])
        full_acc = sum(right(p, winner(p["ids"])) for p in problems) / len(problems)
        lines += ["", f"#### {name} ({len(problems)} problems, n={n}; majority of all paths: "
                  f"gold {full_acc:.3f})", "",
                  "| paths voted | tokens | gold acc | agree w/ all-path vote |", "|---|---|---|---|"]
        for keep in args.keep:
            r = offline(problems, keep, args.window)
            rows.append(dict(traces=name, kind="filtered", keep=keep, **r))
            lines.append(f"| top {keep:.0%} by confidence | 100% | {r['acc']:.3f} | {r['agree']:.1%} |")
            lines.append(f"| top {keep:.0%}, weighted by exp(confidence) | 100% | {r['acc_w']:.3f} | "
                         f"{r['agree_w']:.1%} |")
        rule = StopRule()
        for keep in [None] + list(args.keep):
            for stop in (None, rule):
                runs = [online(problems, keep, args.window, stop, seed)
                        for seed in (range(args.perms) if stop else [0])]
                mean = {k: sum(r[k] for r in runs) / len(runs) for k in ("tokens", "acc", "agree", "ended")}
                rows.append(dict(traces=name, kind="ended", keep=keep,
                                 rule=stop.describe() if stop else "off", **mean,
                                 worst_agree=min(r["agree"] for r in runs)))
                label = ("every path to its end" if keep is None else
                         f"paths ended below the run's {1 - keep:.0%} quantile") + \
                    (f", {stop.describe()} ({len(runs)} orders)" if stop else "")
                lines.append(f"| {label} | {mean['tokens']:.1%} | {mean['acc']:.3f} | {mean['agree']:.1%} "
                             f"(worst {min(r['agree'] for r in runs):.1%}); {mean['ended']:.0f} ended |")
    if not rows:
        return fail(ValueError("no trace set with per-path logprobs"))
    table = "\n".join(["DeepConf-style confidence: lowest mean over windows of "
                       f"{args.window} tokens of the sampled tokens' logprobs."] + lines)
    print(table)
    write_results(args.out, {"args": vars(args), "results": rows}, table)
    return 0
