"""What :mod:`tests.memory_soak` makes of its samples: per-request records,
the progress line, growth after warm-up per server and per owner, latency
windows, the checks against the targets, the plot and a markdown summary.

Targets (issue 42): every good request answered; every malformed one a 4xx
(on this package's routes naming the field); every hang-up's run and paths
gone within 1 s; at the end nothing running, no run, path, client id,
planner or task held; every proposer and endpoint structure within its
bound at every sample; after warm-up the consensus server's resident
memory grows by at most the plain server's growth + 50 MB and at most 3%;
the last window's p50 and p99 latency within 10% of the window right
after warm-up.
"""

from __future__ import annotations

from tests.sc_soak import CHAT, COMPLETIONS, ROUTE
from tests.server_soak import grep_log
from tests.week_traffic import V1_CHAT, V1_COMPLETIONS, plain_equivalent

ROUTES = {V1_COMPLETIONS: "v1", V1_CHAT: "v1chat", ROUTE: "sc", COMPLETIONS: "sc_completions",
          CHAT: "sc_chat"}
HANGUP_END_S = 1.0
MAX_EXTRA_GROWTH_MB = 50.0  # consensus growth after warm-up beyond the plain server's
MAX_GROWTH_PCT = 3.0
MAX_LATENCY_DRIFT = 0.10


def record(item, res: dict) -> dict:
    """One request's outcome, compactly (index, kind, route, ok, status, seconds)."""
    out = {"i": item.index, "k": item.kind, "r": ROUTES.get(item.route, item.route),
           "ok": bool(res.get("ok")), "st": res.get("status"), "s": round(res.get("s", 0.0), 3)}
    if res.get("tokens") is not None:
        out["tok"] = res["tokens"]
    if item.kind == "hangup" and res.get("checked"):
        out.update(end_s=res.get("end_s"), seen=res.get("seen_active"),
                   early=res.get("finished_before_close") or res.get("answered_before_close"))
    if item.kind == "hangup" and not out["ok"]:
        out["body"] = item.body  # to send again by hand
    if item.kind == "bad":
        out["name"] = item.name
        if not out["ok"]:
            out["param"] = res.get("param")
    for key in ("error", "skipped"):
        if res.get(key):
            out[key] = res[key]
    return out


def _counts(reqs: list[dict]) -> dict:
    out = {}
    for kind in ("good", "bad", "hangup"):
        mine = [r for r in reqs if r["k"] == kind]
        out[kind] = len(mine)
        out[kind + "_ok"] = sum(r["ok"] for r in mine)
    checked = [r for r in reqs if r["k"] == "hangup" and "end_s" in r]
    out["hangups_checked"] = len(checked)
    out["hangups_ended_1s"] = sum(r["ok"] and (r["end_s"] or 1e9) <= HANGUP_END_S for r in checked)
    out["hangups_finished_before_close"] = sum(bool(r.get("early")) for r in checked)
    out["hangup_end_s_max"] = max((r["end_s"] for r in checked if r["end_s"] is not None),
                                  default=None)
    out["skipped"] = sum(bool(r.get("skipped")) for r in reqs)
    return out


def progress_line(entry: dict, done: int, total: int, elapsed: float) -> str:
    c = _counts(entry["requests"])
    rate = elapsed / done if done else 0.0
    last = entry["samples"][-1] if entry["samples"] else {}
    return (f"{done}/{total} ({100 * done / total:.0f}%) good {c['good_ok']}/{c['good']} "
            f"malformed {c['bad_ok']}/{c['bad']} hang-ups {c['hangup_ok']}/{c['hangup']} | "
            f"{rate:.2f} s/request, {elapsed / 60:.1f} min, ETA {rate * (total - done) / 60:.1f} min"
            f" | RSS {last.get('rss_mb', 0) / 1024:.2f} GB at {last.get('done', 0)}")


def serial_items(bursts: list, consensus: bool) -> list:
    """One hang-up of each route the server has, for the one-at-a-time check."""
    seen: dict[str, object] = {}
    for b in bursts:
        for it in b.items:
            if it.kind == "hangup":
                it = it if consensus else plain_equivalent(it)
                seen.setdefault(it.route, it)
    return list(seen.values())


def log_errors(text: str) -> dict:
    g = grep_log(text)
    return {k: {"count": g[k]["count"], "lines": g[k]["lines"][:3]}
            for k in ("error_lines", "tracebacks", "http_5xx", "drafting_failed", "drafting_off")}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(q * len(v)))], 3)


def _latency(reqs: list[dict], lo: int, hi: int) -> dict:
    """A window's p50 and p99 seconds a request, and per token generated: the
    second reads the server's speed apart from how many tokens the window's
    requests happened to ask for (a self-consistency request's tokens move
    with its stop)."""
    good = [r for r in reqs if r["k"] == "good" and r["ok"] and lo <= r["i"] < hi]
    s = [r["s"] for r in good]
    ms = [1000.0 * r["s"] / r["tok"] for r in good if r.get("tok")]
    return {"from": lo + 1, "to": hi, "requests": len(s), "p50_s": _pct(s, 0.5), "p99_s": _pct(s, 0.99),
            "p50_ms_per_token": _pct(ms, 0.5), "p99_ms_per_token": _pct(ms, 0.99)}


def _growth(a: dict, b: dict) -> dict:
    keys = sorted(set(a) | set(b))
    return {k: round(b.get(k, 0.0) - a.get(k, 0.0), 1) for k in keys}


def _server_summary(entry: dict, cfg: dict, total: int) -> dict:
    samples = entry.get("samples") or []
    out: dict = {"counts": _counts(entry.get("requests", [])), "wall_s": entry.get("wall_s"),
                 "cpu_s": entry.get("cpu_s"), "ready_s": entry.get("ready_s"),
                 "series_mb": [[s["done"], s["rss_mb"]] for s in samples]}
    done = len(entry.get("requests", []))
    if done and entry.get("wall_s"):
        out["s_per_request"] = round(entry["wall_s"] / done, 3)
    warm = next((s for s in samples if s["done"] >= cfg["warmup"]), None)
    end = samples[-1] if samples else None
    if warm is not None and end is not None and end["done"] > warm["done"]:
        w, e = warm["worker"], end["worker"]
        out["after_warmup"] = {
            "from": warm["done"], "to": end["done"], "rss_mb": [warm["rss_mb"], end["rss_mb"]],
            "growth_mb": round(end["rss_mb"] - warm["rss_mb"], 1),
            "growth_pct": round(100 * (end["rss_mb"] - warm["rss_mb"]) / warm["rss_mb"], 2),
            "by_process_mb": _growth(warm["processes"], end["processes"]),
            "worker_mappings_mb": _growth(w.get("mappings_mb") or {}, e.get("mappings_mb") or {}),
            "worker_malloc_mb": _growth(w.get("malloc") or {}, e.get("malloc") or {}),
            "worker_python_blocks": (e.get("python_blocks") or 0) - (w.get("python_blocks") or 0),
            "worker_grew_most": e.get("grew_since_warmup"),
        }
    window = cfg["window"]
    if total >= cfg["warmup"] + 2 * window:
        reqs = entry.get("requests", [])
        first, last = _latency(reqs, cfg["warmup"], cfg["warmup"] + window), \
            _latency(reqs, total - window, total)
        out["latency"] = {"after_warmup": first, "last": last}
        for q, ratio in (("p50_s", "p50_ratio"), ("p99_s", "p99_ratio"),
                         ("p50_ms_per_token", "p50_per_token_ratio"),
                         ("p99_ms_per_token", "p99_per_token_ratio")):
            if first[q] and last[q]:
                out["latency"][ratio] = round(last[q] / first[q], 3)
    with_bounds = [s for s in samples if s.get("proposer_bounds")]
    if with_bounds:
        bounds = with_bounds[-1]["proposer_bounds"]
        peak = {k: max(s["proposer"].get(k) or 0 for s in with_bounds) for k in bounds}
        out["proposer_peak_vs_bound"] = {k: [peak[k], bounds[k]] for k in bounds}
        out["proposer_within_bounds"] = all(
            (s["proposer"].get(k) or 0) <= s["proposer_bounds"][k]
            for s in with_bounds for k in s["proposer_bounds"])
    with_caches = [s for s in samples if (s.get("endpoint") or {}).get("caches")]
    if with_caches:
        caches = with_caches[-1]["endpoint"]["caches"]
        out["endpoint_caches_end"] = caches
        out["endpoint_caches_within_bounds"] = all(
            held <= bound for s in with_caches for held, bound in s["endpoint"]["caches"].values())
    return out


def summarize(report: dict) -> dict:
    cfg = report["config"]
    out = {name: _server_summary(entry, cfg, cfg["requests"])
           for name, entry in report["servers"].items()}
    p, c = out.get("plain", {}).get("after_warmup"), out.get("consensus", {}).get("after_warmup")
    if p and c:
        out["consensus_minus_plain_growth_mb"] = round(c["growth_mb"] - p["growth_mb"], 1)
    return out


def _nothing_held(entry: dict) -> bool:
    end = entry.get("end") or {}
    state = end.get("endpoint") or {}
    return bool(end.get("idle")) and all(state.get(k) == 0 for k in (
        "requests_active", "paths_in_flight", "client_ids_held", "planners_held", "tasks_held"))


def checks(report: dict) -> dict:
    """Named pass/fail checks (module docstring)."""
    summary, out = report["summary"], {}
    for name, entry in report["servers"].items():
        c = summary[name]["counts"]
        consensus = name == "consensus"
        out[f"{name}: every good request answered"] = c["good"] > 0 and c["good_ok"] == c["good"]
        out[f"{name}: every malformed request a 4xx" + (" naming the field" if consensus else "")] = \
            c["bad_ok"] == c["bad"]
        out[f"{name}: nothing skipped (deadline)"] = c["skipped"] == 0
        serial = entry.get("serial_hangups") or []
        out[f"{name}: hang-ups one at a time end within 1 s"] = bool(serial) and all(
            s["ran"] and s["idle_after"] and s["end_s"] <= HANGUP_END_S for s in serial)
        out[f"{name}: idle at the end"] = bool((entry.get("end") or {}).get("idle"))
        stopped = entry.get("stopped") or {}
        out[f"{name}: stopped cleanly"] = stopped.get("exit_code") is not None \
            and not stopped.get("left_at_end") and not entry.get("error")
        errors = entry.get("log_errors") or {}
        out[f"{name}: no errors in the log"] = all(
            errors.get(k, {}).get("count", 1) == 0 for k in ("error_lines", "tracebacks", "http_5xx"))
        if consensus:
            out["consensus: every hang-up's run ended within 1 s"] = \
                c["hangups_checked"] > 0 and c["hangups_ended_1s"] == c["hangups_checked"]
            out["consensus: no run, path, client id, planner or task held at the end"] = \
                _nothing_held(entry)
            out["consensus: proposer within its bounds at every sample"] = \
                bool(summary[name].get("proposer_within_bounds"))
            out["consensus: endpoint memos within their bounds"] = \
                bool(summary[name].get("endpoint_caches_within_bounds"))
            lat = summary[name].get("latency")
            if lat:
                out["consensus: last window's p50/p99 within 10% of after warm-up"] = all(
                    lat.get(k) is not None and lat[k] <= 1 + MAX_LATENCY_DRIFT
                    for k in ("p50_ratio", "p99_ratio"))
    cw = summary.get("consensus", {}).get("after_warmup")
    if cw:
        out["consensus: RSS growth after warm-up <= 3%"] = cw["growth_pct"] <= MAX_GROWTH_PCT
        extra = summary.get("consensus_minus_plain_growth_mb")
        if extra is not None:
            out["consensus: RSS growth <= plain's + 50 MB"] = extra <= MAX_EXTRA_GROWTH_MB
    return out


def plot(report: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, entry in report["servers"].items():
        samples = entry.get("samples") or []
        x = [s["done"] for s in samples]
        top.plot(x, [s["rss_mb"] for s in samples], marker="o", ms=3, label=f"{name}: process tree")
        top.plot(x, [s["processes"].get("VLLM::Worker", 0) for s in samples], ls="--",
                 label=f"{name}: engine worker")
        heap = [(s["worker"].get("malloc") or {}) for s in samples]
        bottom.plot(x, [h.get("heap", 0) for h in heap], label=f"{name}: worker C heap")
        bottom.plot(x, [h.get("in_use", 0) for h in heap], ls="--", label=f"{name}: of it in use")
    for ax in (top, bottom):
        ax.axvline(report["config"]["warmup"], color="grey", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    top.set_ylabel("resident MB")
    bottom.set_ylabel("MB (mallinfo2)")
    bottom.set_xlabel("requests done")
    top.set_title(f"memory soak: {report['config']['requests']} requests "
                  f"(warm-up {report['config']['warmup']}, dotted)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict) -> str:
    s, cfg = report["summary"], report["config"]
    lines = [f"## memory soak: {cfg['requests']} requests, warm-up {cfg['warmup']}, "
             f"window {cfg['window']} (commit {cfg['commit']})", ""]
    for name, x in s.items():
        if not isinstance(x, dict):
            continue
        c, aw = x["counts"], x.get("after_warmup") or {}
        lines += [f"### {name}", "",
                  f"- good {c['good_ok']}/{c['good']}, malformed {c['bad_ok']}/{c['bad']}, "
                  f"hang-ups {c['hangup_ok']}/{c['hangup']} (checked {c['hangups_checked']}, "
                  f"ended within 1 s {c['hangups_ended_1s']}, slowest {c['hangup_end_s_max']} s)",
                  f"- wall {x.get('wall_s')} s ({x.get('s_per_request')} s a request), server CPU "
                  f"{x.get('cpu_s')} s, ready in {x.get('ready_s')} s",
                  f"- RSS after warm-up {aw.get('rss_mb')} MB: {aw.get('growth_mb')} MB "
                  f"({aw.get('growth_pct')}%); by process {aw.get('by_process_mb')}",
                  f"- worker mappings growth {aw.get('worker_mappings_mb')}; C heap "
                  f"{aw.get('worker_malloc_mb')}; Python blocks {aw.get('worker_python_blocks')}",
                  f"- latency {x.get('latency')}", f"- series {x.get('series_mb')}"]
        if x.get("proposer_peak_vs_bound"):
            lines.append(f"- proposer peak vs bound {x['proposer_peak_vs_bound']}")
        if x.get("endpoint_caches_end"):
            lines.append(f"- endpoint memos at the end [held, bound] {x['endpoint_caches_end']}")
        lines.append("")
    if "consensus_minus_plain_growth_mb" in s:
        lines += [f"consensus growth minus plain growth: {s['consensus_minus_plain_growth_mb']} MB", ""]
    lines += ["| check | result |", "|---|---|"]
    lines += [f"| {k} | {'PASS' if v else 'FAIL'} |" for k, v in report["checks"].items()]
    return "\n".join(lines)

