"""Fit and check the forecast of running paths on recorded traces (an
experiment, :mod:`evals.adaptive.forecast_model`: it measured no gain and
left the library).

    python -m evals forecast [--traces FILE ...] [--limit N] [--write JSON]

For every recorded path: is it still running at each band edge of progress
(tokens so far over the median length of its problem's other paths), and
is the last answer in its text so far the full-N leader's, another, or
none?  :meth:`ForecastModel.fit` turns that into likelihood ratios per band
and state (:mod:`evals.adaptive.forecast_model`).  Prints, per set, the
ratios fitted on it and how a model fitted on the *other* sets forecasts
it (mean log loss and Brier score of P(ends on the leader) against the
vote's own prediction alone, at each band), so a model is never judged on
the paths it was fitted on.  ``--write`` fits on every set given and
writes the model's JSON (``evals/adaptive/forecast.json`` is made so: the
model ``waves --forecast-model saved`` replays).
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

from consensus_spec.voting.answers import answers_equal

from ..options import add_trace_args, fail, trace_sets, write_json
from ..traces import load_tokenizer
from .forecast_model import PROGRESS_BANDS, STATES, ForecastModel, evidence
from .stop_rules import DEFAULT_TRACES
from .vote_traces import answer_extractor, load_vote_traces, winner


class PathTexts:
    """Vote traces' completion texts, cut at a number of tokens: at the
    tokenizer's offsets, or, for lines recorded with their token ids
    (``evals record``: no tokenizer here), at the same share of the text's
    characters.  ``extract`` reads partial texts as the vote reads whole ones."""

    def __init__(self, traces, tokenizer, extract):
        self.tokenizer, self.extract = tokenizer, extract
        self.texts: dict[str, list[str]] = {t.id: t.texts for t in traces}
        self._offsets: dict[tuple[str, int], list[int]] = {
            (t.id, k): [round(len(text) * (i + 1) / count) for i in range(count)]
            for t in traces if t.recorded for k, (text, count) in enumerate(zip(t.texts, t.tokens))}

    def cut(self, pid: str, k: int, tokens: int) -> str:
        """Path ``k``'s text after its first ``tokens`` tokens."""
        key = (pid, k)
        ends = self._offsets.get(key)
        if ends is None:
            enc = self.tokenizer.load().encode(self.texts[pid][k])
            ends = self._offsets[key] = [end for _, end in enc.offsets]
        if tokens <= 0 or not ends:
            return ""
        return self.texts[pid][k][:ends[min(tokens, len(ends)) - 1]]


def path_checks(trace, texts: PathTexts, extract, bands) -> list[tuple[bool, list[tuple[float, str]]]]:
    """Per path of one problem: (ends on the full-N leader, its checks)."""
    lead = winner(trace.ids)
    if lead is None:
        return []
    leader = trace.answers[trace.ids.index(lead)]
    out = []
    for k, (cls, length) in enumerate(zip(trace.ids, trace.tokens)):
        others = trace.tokens[:k] + trace.tokens[k + 1:]
        median = float(np.median(others))
        checks = []
        for edge in bands:
            tokens = int(edge * median)
            if tokens >= length - 1:  # finished by then (its last token is EOS)
                break
            checks.append((edge, evidence(texts.cut(trace.id, k, tokens), leader, extract,
                                          answers_equal)))
        out.append((cls == lead, checks))
    return out


def load_paths(path: str, tokenizer, limit: int | None, bands, skip_bad: bool = False) -> list:
    traces = load_vote_traces(path, tokenizer, limit=limit, skip_bad=skip_bad)
    cut = PathTexts(traces, tokenizer, answer_extractor(path))
    return [pc for t in traces for pc in path_checks(t, cut, cut.extract, bands)]


def score(model: ForecastModel, paths: list, base: float) -> dict[int, tuple[int, float, float]]:
    """Per band: (checks, mean log loss, mean log loss of ``base`` alone)."""
    acc: dict[int, list] = {}
    for on_leader, checks in paths:
        for progress, state in checks:
            q = min(max(model.p_leader(base, progress, state), 1e-6), 1 - 1e-6)
            b = min(max(base, 1e-6), 1 - 1e-6)
            loss = -math.log(q if on_leader else 1 - q)
            loss0 = -math.log(b if on_leader else 1 - b)
            acc.setdefault(model.band(progress), []).append((loss, loss0))
    return {band: (len(v), sum(x for x, _ in v) / len(v), sum(y for _, y in v) / len(v))
            for band, v in sorted(acc.items())}


def fit_others(sets: dict[str, list], name: str) -> ForecastModel:
    """The model for set ``name`` fitted on the other sets (itself if alone)."""
    others = [n for n in sets if n != name] or [name]
    return ForecastModel.fit([p for n in others for p in sets[n]], fitted_on="+".join(others))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals forecast", description=__doc__.split("\n\n")[0])
    add_trace_args(ap, "gsm8k, addsub and svamp")
    ap.add_argument("--write", help="fit on every set given and write the model's JSON here")
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    sets = {}
    try:
        for name, path in trace_sets(args.traces, DEFAULT_TRACES):
            sets[name] = load_paths(path, tokenizer, args.limit, PROGRESS_BANDS, args.skip_bad_lines)
            print(f"{name}: {len(sets[name])} paths", file=sys.stderr, flush=True)
    except (OSError, ValueError) as e:
        return fail(e)
    labels = ["< %g" % PROGRESS_BANDS[0]] + [f"{a:g}-{b:g}" for a, b in zip(PROGRESS_BANDS, PROGRESS_BANDS[1:])] \
        + [f">= {PROGRESS_BANDS[-1]:g}"]
    for name, paths in sets.items():
        own = ForecastModel.fit(paths, fitted_on=name)
        held = fit_others(sets, name)
        share = sum(p[0] for p in paths) / max(len(paths), 1)
        print(f"\n### {name}: {len(paths)} paths, {100 * share:.1f}% end on the full-N leader\n")
        print("| progress | " + " | ".join(f"log LR {s} (own)" for s in STATES)
              + " | checks | log loss, model of the other sets | log loss, share alone |")
        print("|---" * (len(STATES) + 4) + "|")
        scores = score(held, paths, share)
        for b, label in enumerate(labels):
            n, loss, loss0 = scores.get(b, (0, float("nan"), float("nan")))
            print(f"| {label} | " + " | ".join(f"{x:+.2f}" for x in own.log_ratio[b])
                  + f" | {n} | {loss:.3f} | {loss0:.3f} |")
    if args.write:
        model = ForecastModel.fit([p for paths in sets.values() for p in paths],
                                  fitted_on="+".join(sets))
        write_json(args.write, model.to_json())
        print(f"\nwrote {args.write}")
    return 0
