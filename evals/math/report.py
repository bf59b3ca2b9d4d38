"""Comparisons, tables and plots of ``python -m evals math``.

Rows are dicts made by :func:`evals.math.runs.make_row`.  A *plain* row runs
all n paths at once without early stop (waves ``all``, early stop ``off``);
the other rows of the same method and n are compared with it: tokens, the
full-n answer agreement, and a replay of their stop rule on the plain run's
own samples (the stopping error alone, without the sampling noise that two
independent runs add).
"""

from __future__ import annotations

import statistics
from typing import Iterable

from ..adaptive.stop_rules import prefix_tallies, replay_order, wave_ends
from ..adaptive.vote_traces import answer_classes
from ..options import parse_early_stop
from ..plots import load_pyplot, save_figure

PLAIN = ("all", "off")
# Rules replayed for the trade-off curve (waves: the run's, or the default).
TRADEOFF_RULES = ("decided", "bayes:0.001", "bayes:0.002", "bayes:0.005", "bayes:0.01",
                  "sequential:0.2", "adaptive", "esc", "consol")


def public(rows: list[dict]) -> list[dict]:
    """The rows without their in-memory fields (``_stop_rule``, ``_classes``), for JSON."""
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


def is_plain(r: dict) -> bool:
    return (r["waves"], r["early_stop"]) == PLAIN


def _plain(rows: list[dict], method: str, n: int) -> dict | None:
    return next((p for p in rows if is_plain(p) and p["method"] == method and p["n"] == n), None)


def answer_agreement(row: dict, ref: dict) -> float | None:
    """Share of problems whose voted answer equals ``ref``'s (same problems;
    two None answers are equal)."""
    from consensus_spec.voting.answers import answers_equal

    pairs = list(zip(row["per_problem"], ref["per_problem"]))
    if not pairs or any(a["id"] != b["id"] for a, b in pairs):
        return None
    return sum(a["answer"] == b["answer"] or answers_equal(a["answer"], b["answer"])
               for a, b in pairs) / len(pairs)


def repeats(rows: list[dict]) -> list[list[dict]]:
    """The rows of each repeat (``python -m evals math --repeats``), in order;
    rows written before repeats existed are one repeat."""
    out: dict[int, list[dict]] = {}
    for r in rows:
        out.setdefault(r.get("repeat", 0), []).append(r)
    return [out[k] for k in sorted(out)]


def add_comparisons(rows: list[dict]) -> None:
    """:func:`compare` within each repeat: a repeat's rows against its own
    ``none`` and plain runs, measured beside them."""
    for part in repeats(rows):
        compare(part)


def compare(rows: list[dict]) -> None:
    """Per row: ``speedup`` (tokens/s vs ``none`` at the same n, waves and
    early stop: the drafting gain), ``wall_speedup`` (wall time of plain
    ``none`` at the same n over this row's: the end-to-end gain),
    ``tokens_vs_plain`` and ``agreement`` (voted answer equal to the full-n
    answer of the plain run of the same method and n), and the replay of this
    row's stop rule on that plain run (``replay_agreement``, ``replay_tokens``)."""
    base = {(r["n"], r["waves"], r["early_stop"]): r for r in rows if r["method"] == "none"}
    for r in rows:
        b = base.get((r["n"], r["waves"], r["early_stop"]))
        ok = b is not None and b["tokens_per_s"] and r["tokens_per_s"]
        r["speedup"] = r["tokens_per_s"] / b["tokens_per_s"] if ok else None
        plain_none = _plain(rows, "none", r["n"])
        r["wall_speedup"] = (plain_none["wall_time_s"] / r["wall_time_s"]
                             if plain_none and r["wall_time_s"] else None)
        cpu, base_cpu = r.get("cpu_time_s"), plain_none and plain_none.get("cpu_time_s")
        r["cpu_speedup"] = base_cpu / cpu if base_cpu and cpu else None
        plain = _plain(rows, r["method"], r["n"])
        r["tokens_vs_plain"] = r["tokens"] / plain["tokens"] if plain and plain["tokens"] else None
        r["agreement"] = answer_agreement(r, plain) if plain is not None and r is not plain else None
        r["replay_agreement"] = r["replay_tokens"] = None
        if plain is not None and r.get("_stop_rule") is not None:
            rep = replay(plain, r["wave_sizes"], r["_stop_rule"], r.get("check", "wave"))  # older files: waves
            r["replay_agreement"], r["replay_tokens"] = rep["agreement"], rep["tokens_frac"]


def noise_floor(rows: list[dict]) -> list[tuple[str, str, int, float]]:
    """Full-n answer agreement between plain runs of different methods (in
    the same repeat): what two independent runs of n samples agree on (the
    floor for ``agreement``)."""
    plains = [r for r in rows if is_plain(r)]
    out = []
    for i, a in enumerate(plains):
        for b in plains[i + 1:]:
            if a["n"] == b["n"] and a.get("repeat", 0) == b.get("repeat", 0):
                value = answer_agreement(a, b)
                if value is not None:
                    out.append((a["method"], b["method"], a["n"], value))
    return out


# -- Scoring a run against gold answers


def score(run, problems) -> dict:
    """Accuracy figures of one self-consistency run plus per-problem detail."""
    from consensus_spec.voting.answers import answers_equal

    details, pass1, maj = [], [], []
    for prob, res in zip(problems, run):
        answers = [s.answer for s in res.samples]
        right = {a: answers_equal(a, prob.gold) for a in {res.answer, *answers}}  # once per answer
        correct = sum(right[a] for a in answers)
        p1 = correct / len(res.samples) if res.samples else 0.0
        voted = right[res.answer]
        pass1.append(p1)
        maj.append(voted)
        details.append(dict(id=prob.id, gold=prob.gold, answer=res.answer, correct=voted,
                            agreement=round(res.agreement, 4), samples=len(res.samples),
                            samples_correct=correct, stopped_early=res.stopped_early,
                            tokens=res.num_tokens, waves=getattr(res, "waves", None),
                            answers=answers,
                            sample_tokens=[getattr(s, "num_tokens", 0) for s in res.samples]))
    count = max(1, len(problems))
    return dict(pass_at_1=sum(pass1) / count, maj_at_n=sum(maj) / count, per_problem=details)


# -- Replay of a stop rule on a plain run's samples


def replay(plain: dict, wave_sizes: list[int], rule, check: str = "index") -> dict:
    """Stop ``rule`` replayed on a plain run's samples in path order (a random
    order: all paths ran at once), checked after every path (``check``
    ``"index"`` or ``"path"``) or after the waves ``wave_sizes`` (``"wave"``).  Returns the share of tokens used,
    agreement with the plain run's own full-n vote, and maj accuracy."""
    used_tok = full_tok = agree = correct = 0
    problems = answer_classes(plain)
    for ids, tokens, right in problems:
        n = len(ids)
        checks = wave_ends(wave_sizes, n) if check == "wave" else list(range(1, n))
        _, tok, stopped, full = replay_order(ids, tokens, rule, checks, prefix_tallies(ids))
        used_tok += tok
        full_tok += sum(tokens)
        agree += stopped in full
        correct += stopped is not None and right[stopped]
    count = max(1, len(problems))
    return dict(tokens_frac=used_tok / full_tok if full_tok else None, agreement=agree / count,
                maj=correct / count)


def tradeoff(rows: list[dict], rules: Iterable[str] = TRADEOFF_RULES) -> list[dict]:
    """Replay ``rules`` x the waves (and checks) of this run (default waves if
    none) on every plain row: the tokens-vs-agreement curve."""
    from consensus_spec.sampling.waves import Schedule

    waves = {(r["waves"], r.get("check", "wave")) for r in rows
             if not is_plain(r) and r["waves"] != "all"} or {("default", Schedule().check)}
    out = []
    for plain in (r for r in rows if is_plain(r)):
        for w, check in sorted(waves):
            schedule = Schedule() if w == "default" else Schedule.parse(w.split("+")[0], check=check)
            sizes = schedule.sizes(plain["n"])
            for spec in rules:
                (rule,) = parse_early_stop([spec])
                rep = replay(plain, sizes, rule, check)
                out.append(dict(method=plain["method"], n=plain["n"], waves=schedule.describe(),
                                rule=rule.describe(), **rep, maj_full=plain["maj_at_n"]))
    return out


# -- Tables and plots


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(rows: list[dict]) -> str:
    many = len(repeats(rows)) > 1
    head = (("| repeat " if many else "") + "| method | n | waves | early stop | pass@1 | maj@n | "
            "agree w/ plain full-n | replay agree | tokens | tokens vs plain | samples/problem | "
            "stopped | tok/s | wall s | "
            "speedup (tok/s) | wall speedup vs plain none | cpu s | cpu speedup vs plain none | "
            "batch fill | accept len | drafted | accepted |")
    lines = [head, "|" + "---|" * (22 + many)]
    for r in rows:
        lines.append(
            (f"| {r.get('repeat', 0)} " if many else "")
            + f"| {r['method']} | {r['n']} | {r['waves']} | {r['early_stop']} | "
            f"{r['pass_at_1']:.3f} | {r['maj_at_n']:.3f} | {_f(r.get('agreement'), '.3f')} | "
            f"{_f(r.get('replay_agreement'), '.3f')} | {r['tokens']} | "
            f"{_f(r.get('tokens_vs_plain'), '.3f')} | {_f(r.get('samples_per_problem'), '.2f')} | "
            f"{r.get('stopped_early', 0)} | {_f(r['tokens_per_s'], '.1f')} | {r['wall_time_s']:.1f} | "
            f"{_f(r.get('speedup'), '.2f')} | {_f(r.get('wall_speedup'), '.2f')} | "
            f"{_f(r.get('cpu_time_s'), '.1f')} | {_f(r.get('cpu_speedup'), '.2f')} | "
            f"{_f(r.get('batch_fill'), '.3f')} | {_f(r['mean_acceptance_length'], '.2f')} | "
            f"{r['drafted_tokens']} | {r['accepted_tokens']} |")
    if many:
        lines += ["", spread_markdown(rows)]
    floor = noise_floor(rows)
    if floor:
        lines += ["", "Full-n answer agreement between plain runs (two independent samples; the "
                  "floor for 'agree w/ plain full-n'): " + ", ".join(
                      f"{a} vs {b} (n={n}) {v:.3f}" for a, b, n, v in floor)]
    return "\n".join(lines)


def spread(rows: list[dict]) -> list[dict]:
    """Per method and config (plain ``none`` left out), over the repeats: its
    wall and CPU speedups (:func:`add_comparisons`' per-repeat figures),
    sorted, and the ratio of the summed times to the plain ``none`` runs'."""
    bases = {(r.get("repeat", 0), r["n"]): r for r in rows if r["method"] == "none" and is_plain(r)}
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for r in rows:
        base = bases.get((r.get("repeat", 0), r["n"]))
        if base is not None and base is not r:
            groups.setdefault((r["method"], r["n"], r["waves"], r["early_stop"]), []).append((base, r))
    out = []
    for (method, n, waves, early_stop), pairs in groups.items():
        entry = dict(method=method, n=n, waves=waves, early_stop=early_stop, repeats=len(pairs))
        for name, field in (("wall", "wall_time_s"), ("cpu", "cpu_time_s")):
            ratios = sorted(r[name + "_speedup"] for _, r in pairs if r.get(name + "_speedup") is not None)
            entry[name] = ratios
            total = sum(r.get(field) or 0 for _, r in pairs)
            entry[name + "_summed"] = (sum(b.get(field) or 0 for b, _ in pairs) / total
                                       if total and len(ratios) == len(pairs) else None)
        out.append(entry)
    return out


def spread_markdown(rows: list[dict]) -> str:
    def cell(ratios: list[float], summed) -> str:
        if not ratios:
            return "-"
        return (f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}–{ratios[-1]:.2f})"
                + ("" if summed is None else f", summed {summed:.2f}"))

    lines = ["Speedup over plain none, per repeat (methods in alternating order): median (range), "
             "and the ratio of the summed times", "",
             "| method | n | waves | early stop | repeats | wall | cpu |", "|---|---|---|---|---|---|---|"]
    for e in spread(rows):
        lines.append(f"| {e['method']} | {e['n']} | {e['waves']} | {e['early_stop']} | "
                     f"{e['repeats']} | {cell(e['wall'], e['wall_summed'])} | "
                     f"{cell(e['cpu'], e['cpu_summed'])} |")
    return "\n".join(lines)


def tradeoff_markdown(points: list[dict]) -> str:
    lines = ["| plain run | n | waves | rule (replayed) | tokens % of plain | agree % w/ full-n | "
             "maj@n stopped / full |", "|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['method']} | {p['n']} | {p['waves']} | {p['rule']} | "
                     f"{100 * p['tokens_frac']:.1f} | {100 * p['agreement']:.1f} | "
                     f"{p['maj']:.3f} / {p['maj_full']:.3f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> bool:
    """Speedup and accuracy against n, one line per method/waves/early stop."""
    matplotlib, plt = load_pyplot()
    if plt is None:
        return False
    series: dict[str, list[dict]] = {}
    for r in rows:
        label = r["method"] + ("" if is_plain(r) else f" waves={r['waves']} es={r['early_stop']}")
        series.setdefault(label, []).append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, rs in series.items():
        rs = _median_per_n(rs)
        ns = [r["n"] for r in rs]
        sp = [r.get("wall_speedup") for r in rs]
        if any(s is not None for s in sp):
            ax1.plot(ns, [float("nan") if s is None else s for s in sp], "o-", label=label)
        line, = ax2.plot(ns, [r["maj_at_n"] for r in rs], "o-", label=f"{label} maj@n")
        ax2.plot(ns, [r["pass_at_1"] for r in rs], "x--", color=line.get_color(), alpha=0.6,
                 label=f"{label} pass@1")
    for ax in (ax1, ax2):
        ax.set_xlabel("n (samples per problem)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["n"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(alpha=0.3)
    ax1.set_ylabel("wall-time speedup vs plain none")
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set_title("end-to-end speedup")
    ax2.set_ylabel("accuracy")
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_title("accuracy")
    for ax in (ax1, ax2):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return save_figure(plt, fig, path)


def _median_per_n(rows: list[dict]) -> list[dict]:
    """One point per n (repeats: the median speedup, the mean accuracies), by n."""
    by_n: dict[int, list[dict]] = {}
    for r in rows:
        by_n.setdefault(r["n"], []).append(r)
    out = []
    for n in sorted(by_n):
        rs = by_n[n]
        sp = [r["wall_speedup"] for r in rs if r.get("wall_speedup") is not None]
        out.append(dict(n=n, wall_speedup=statistics.median(sp) if sp else None,
                        maj_at_n=statistics.fmean(r["maj_at_n"] for r in rs),
                        pass_at_1=statistics.fmean(r["pass_at_1"] for r in rs)))
    return out


def plot_tradeoff(rows: list[dict], points: list[dict], path: str) -> bool:
    """Tokens (share of the plain run) against agreement with its full-n answer:
    replayed rules as curves, measured runs as large markers."""
    _, plt = load_pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.6))
    curves: dict[tuple, list[dict]] = {}
    for p in points:
        curves.setdefault((p["method"], p["n"], p["waves"]), []).append(p)
    for (method, n, waves), ps in curves.items():
        ps = sorted(ps, key=lambda p: p["tokens_frac"])
        ax.plot([100 * p["tokens_frac"] for p in ps], [100 * p["agreement"] for p in ps], ".-",
                alpha=0.7, label=f"replay on plain {method} n={n}, waves {waves}")
    for r in rows:
        if is_plain(r) or r.get("tokens_vs_plain") is None or r.get("agreement") is None:
            continue
        ax.plot(100 * r["tokens_vs_plain"], 100 * r["agreement"], "o", ms=9,
                label=f"measured {r['method']} waves={r['waves']} es={r['early_stop']}")
    for a, b, n, v in noise_floor(rows):
        ax.axhline(100 * v, color="gray", ls=":", lw=1,
                   label=f"plain {a} vs plain {b} (n={n})")
    ax.set_xlabel("tokens, % of plain self-consistency (same method)")
    ax.set_ylabel("% problems agreeing with the full-n answer")
    ax.set_title("adaptive stopping: tokens vs agreement")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(plt, fig, path)
