"""Choosing a stop rule across trace sets for ``python -m evals stop-rules``:
targets, leave-one-set-out cross-validation, tables and the trade-off plot
(docs/stopping.md, "Evaluation", tells the procedure and its reasons).
Every figure here is over random path orders; the targets are ``TARGET_*``.
"""

from __future__ import annotations


TARGET_AGREE, TARGET_WORST, TARGET_GOLD_GAP = 0.995, 0.99, 0.005
OURS = ("bayes", "decided", "sequential")  # the kinds the default is chosen from
FOLD_TITLES = ("Leave-one-set-out, our rules (sets the default)",
               "Leave-one-set-out, rules with a guarantee over every look",
               "Leave-one-set-out, any rule (peers included)")
GUARANTEED = ("decided", "sequential")  # kinds whose error holds over all looks


def pct(x, digits=1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}"


def nominal(r: dict) -> float | None:
    """A rule's stated error (0 for ``decided``; None: no stated error)."""
    return 0.0 if r["rule"]["kind"] == "decided" else r["rule"].get("error")


def gold_full(r: dict) -> float | None:
    """Full-N gold accuracy over the same random orders (a tie's winner depends on the order)."""
    return r.get("gold_acc_full_perm_mean", r.get("gold_acc_full"))


def gold_gap(r: dict) -> float | None:
    if r.get("gold_acc_perm_mean") is None or gold_full(r) is None:
        return None
    return gold_full(r) - r["gold_acc_perm_mean"]


def meets(r: dict) -> bool:
    """The targets on one set (random orders)."""
    nom, gap = nominal(r), gold_gap(r)
    return (r["agreement_perm_mean"] >= TARGET_AGREE and r["agreement_perm_worst"] >= TARGET_WORST
            and (nom is None or 1.0 - r["agreement_perm_mean"] <= nom + 1e-12)
            and (gap is None or gap <= TARGET_GOLD_GAP + 1e-12))


def nested_sources(names: list[str]) -> dict[str, list[tuple[str, ...]]]:
    """Per set, the sets each of its priors is fitted on: all the others
    (its own figures), and for each fold that holds out another set, the
    rest (its figures as a tuning set there)."""
    out = {}
    for s in names:
        others = tuple(x for x in names if x != s)
        out[s] = [others] + [tuple(x for x in others if x != held) for held in others]
    return out


def tuning_figures(sets: dict[str, dict], name: str, rule: str, tune: list[str]) -> dict:
    """``rule``'s figures on ``name`` as one of the tuning sets ``tune``: a
    ``bayes`` rule's prior fitted on the other tuning sets only."""
    s = sets[name]
    source = "+".join(x for x in tune if x != name)
    return s.get("tuning", {}).get(source, {}).get(rule, s["rules"][rule])


def pick(sets: dict[str, dict], names: list[str], kinds=None) -> str:
    """Cheapest rule meeting the targets on every set of ``names`` (else
    ``decided``)."""
    rules = sets[names[0]]["rules"]
    ok = [r for r in rules if (kinds is None or rules[r]["rule"]["kind"] in kinds)
          and all(meets(tuning_figures(sets, s, r, names)) for s in names)]
    if not ok:
        return "decided"
    return min(ok, key=lambda r: (round(sum(tuning_figures(sets, s, r, names)["tokens_frac_perm_mean"]
                                            for s in names) / len(names), 9), r))


def loso(sets: dict[str, dict], kinds=None) -> list[dict]:
    """Per held-out set: the rule picked on the other sets and its held-out figures."""
    out = []
    for held in sets:
        tune = [s for s in sets if s != held]
        if not tune:
            continue
        name = pick(sets, tune, kinds)
        r = sets[held]["rules"][name]
        out.append({"held_out": held, "tuned_on": tune, "rule": name, "meets": meets(r),
                    "nominal": nominal(r), **{k: r.get(k) for k in (
                        "tokens_frac_perm_mean", "agreement_perm_mean", "agreement_perm_worst",
                        "agreement", "gold_acc_perm_mean", "gold_acc_full", "gold_acc_full_perm_mean")}})
    return out


def choose_default(sets: dict[str, dict], folds: list[dict]) -> str:
    """The folds' common pick, else the most cautious of them: the one
    whose worst set agrees most (then the one using more tokens)."""
    picks = {f["rule"] for f in folds} or {pick(sets, list(sets), OURS)}
    if "decided" in picks:
        return "decided"
    table = summary(sets)
    return max(picks, key=lambda r: (min(s["rules"][r]["agreement_perm_mean"] for s in sets.values()),
                                     table[r]["tokens_frac_mean"], r))


def summary(sets: dict[str, dict]) -> dict[str, dict]:
    """Per rule over all sets: mean token share, the worst set's agreement
    (mean of orders) and whether every set meets the targets."""
    names = next(iter(sets.values()))["rules"]
    return {r: {"tokens_frac_mean": sum(s["rules"][r]["tokens_frac_perm_mean"] for s in sets.values())
                / len(sets),
                "agreement_worst_set": min(s["rules"][r]["agreement_perm_mean"] for s in sets.values()),
                "meets_all": all(meets(s["rules"][r]) for s in sets.values())}
            for r in names}


def peers_table(sets: dict[str, dict], default: str) -> str:
    """The default beside the published rules at their published settings:
    per set tokens % / agreement % (mean of the random orders)."""
    names = [default, default + " static", "sequential(error=0.2, min=3)", "adaptive(error=0.05)",
             "esc(5)", "consol"]
    names = [n for n in dict.fromkeys(names) if n in next(iter(sets.values()))["rules"]]
    table = summary(sets)
    lines = ["| rule | " + " | ".join(sets) + " | mean tokens % | worst set's agreement % |",
             "|---" * (len(sets) + 3) + "|"]
    for n in names:
        cells = [f"{pct(s['rules'][n]['tokens_frac_perm_mean'])} / {pct(s['rules'][n]['agreement_perm_mean'], 2)}"
                 for s in sets.values()]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {pct(table[n]['tokens_frac_mean'])} | "
                     f"{pct(table[n]['agreement_worst_set'], 2)} |")
    return "\n".join(lines)


def wait_table(sets: dict[str, dict], default: str) -> str:
    """What stopping can do for one problem alone with every path at once (a
    token a step): the answer waits for the longest path the vote used, in
    path order (random orders, what the engine does) and shortest first
    (the finishing order, biased to short answers), as a share of the longest path."""
    lines = [f"| alone, all paths at once: {default}'s wait for its answer / the last path's | "
             "path order | agreement | shortest first | agreement |", "|---|---|---|---|---|"]
    for name, s in sets.items():
        r = s["rules"][default]
        if "answer_wait_frac_perm_mean" not in r:  # a result saved before this column
            continue
        first = r["shortest_first"]
        lines.append(f"| {name} | {pct(r['answer_wait_frac_perm_mean'])}% | {pct(r['agreement_perm_mean'], 2)}% | "
                     f"{pct(first['answer_wait_frac'])}% | {pct(first['agreement'], 2)}% |")
    return "\n".join(lines)


def gold(r: dict) -> str:
    return "-" if gold_full(r) is None else f"{pct(r.get('gold_acc_perm_mean'), 2)} / {pct(gold_full(r), 2)}"


def realized(r: dict, nom: float | None) -> str:
    return f"{pct(1 - r['agreement_perm_mean'], 2)} / {'-' if nom is None else pct(nom, 1)}"


def set_tables(sets: dict[str, dict], default: str) -> str:
    lines = ["| set | rule | tokens % (worst order) | agree % orders mean / worst / recorded | "
             "disagree % realized / nominal | hard agree % (n) | gold % stopped / full-N | targets |",
             "|---|---|---|---|---|---|---|---|"]
    for set_name, s in sets.items():
        for name, r in s["rules"].items():
            mark = " **(default)**" if name == default else ""
            lines.append(
                f"| {set_name} | {name}{mark} | {pct(r['tokens_frac_perm_mean'])} "
                f"({pct(r['tokens_frac_perm_worst'])}) | {pct(r['agreement_perm_mean'], 2)} / "
                f"{pct(r['agreement_perm_worst'], 2)} / {pct(r['agreement'], 2)} | {realized(r, nominal(r))} | "
                f"{pct(r.get('hard_agreement_perm_mean'))} ({s['hard_problems']}) | {gold(r)} | "
                f"{'yes' if meets(r) else 'no'} |")
    return "\n".join(lines)


def loso_table(folds: list[dict], title: str) -> str:
    lines = [f"**{title}**", "",
             "| held-out set | picked on the other sets | tokens % | agree % orders mean | "
             "worst of orders % | recorded order % | disagree % realized / nominal | "
             "gold % stopped / full-N | targets |", "|---|---|---|---|---|---|---|---|---|"]
    for f in folds:
        lines.append(f"| {f['held_out']} | {f['rule']} | {pct(f['tokens_frac_perm_mean'])} | "
                     f"{pct(f['agreement_perm_mean'], 2)} | {pct(f['agreement_perm_worst'], 2)} | "
                     f"{pct(f['agreement'], 2)} | {realized(f, f['nominal'])} | "
                     f"{gold(f)} | {'yes' if f['meets'] else 'no'} |")
    if folds:
        mean = sum(f["tokens_frac_perm_mean"] for f in folds) / len(folds)
        lines += ["", f"Mean held-out token share: {pct(mean)}% of full-N."]
    return "\n".join(lines)


def markdown(sets: dict[str, dict], default: str, folds: dict[str, list[dict]]) -> str:
    """Tables: the default beside the peers, the folds (``folds``: title ->
    folds), every rule per set, and the summary."""
    text = ["**Ours beside the peers (tokens % / agreement %, mean of the random orders)**", "",
            peers_table(sets, default), "", wait_table(sets, default), ""]
    for title, fs in folds.items():
        if fs:
            text += [loso_table(fs, title), ""]
    text += [set_tables(sets, default), ""]
    table = summary(sets)
    text += ["| rule | mean tokens % over sets | worst set's agreement % | every set meets the targets |",
             "|---|---|---|---|"]
    for name, v in sorted(table.items(), key=lambda kv: kv[1]["tokens_frac_mean"]):
        mark = " **(default)**" if name == default else ""
        text.append(f"| {name}{mark} | {pct(v['tokens_frac_mean'])} | {pct(v['agreement_worst_set'], 2)} | "
                    f"{'yes' if v['meets_all'] else 'no'} |")
    return "\n".join(text)


def plot(sets: dict[str, dict], default: str, path: str, looks: str = "every path") -> bool:
    """Token share against agreement, per set and rule family; the default starred."""
    from ..plots import load_pyplot, save_figure

    _, plt = load_pyplot()
    if plt is None:
        return False
    markers = {"bayes": "*", "sequential": "o", "predictive": "s", "beta": "^", "window": "v",
               "margin": "D", "decided": "X", "adaptive": "P", "esc": "<", "consol": ">"}
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, (set_name, s) in enumerate(sets.items()):
        color = f"C{i}"
        for kind, marker in markers.items():
            pts = sorted((100 * r["tokens_frac_perm_mean"], 100 * r["agreement_perm_mean"])
                         for r in s["rules"].values()
                         if r["rule"]["kind"] == kind and r["rule"].get("learn", True))
            if pts:
                ax.plot(*zip(*pts), marker=marker, color=color, alpha=0.8, markersize=5,
                        linestyle={"bayes": "-", "sequential": "--", "adaptive": ":"}.get(kind, "none"))
        r = s["rules"][default]
        ax.plot(100 * r["tokens_frac_perm_mean"], 100 * r["agreement_perm_mean"], marker="*",
                color=color, markersize=18, markeredgecolor="black", linestyle="none")
        ax.plot([], [], color=color, linewidth=6, label=set_name)
    for kind, marker in markers.items():
        ax.plot([], [], marker=marker, color="gray", linestyle="none", label=kind)
    ax.plot([], [], marker="*", color="gray", markeredgecolor="black", markersize=14,
            linestyle="none", label=f"default: {default}")
    ax.axhline(100 * TARGET_AGREE, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("tokens, % of all N paths (mean over random orders)")
    ax.set_ylabel("agreement with the full-N vote, % (mean over random orders)")
    ax.text(0.01, 0.01, "below 98.5%: off the chart", transform=ax.transAxes, fontsize=7, color="gray")
    ax.set_title(f"Adaptive stopping: tokens against agreement ({looks})")
    ax.set_ylim(98.5, 100.05)  # the targets' range; looser heuristics fall off the chart
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    return save_figure(plt, fig, path)
