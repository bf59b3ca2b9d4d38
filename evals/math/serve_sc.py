"""``python -m evals serve-sc``: self-consistency through a vLLM server, four ways.

Concurrent clients (closed loop: each sends its next problem when its answer
is back) ask for the voted answer of the embedded model's test problems:

- ``endpoint``: ``POST /v1/self_consistency`` (early stop: the library's
  default rule; the engine's load picks waves or every path at once) on a
  server with consensus drafting;
- ``endpoint-openai``: the same through ``POST /v1/self_consistency/completions``
  (the OpenAI-shaped route; the vote read from ``choices[0].self_consistency``);
- ``endpoint-full``: the same endpoint without early stopping (all n paths);
- ``client-drafting``: the best a user does without the endpoint, ``n``
  paths in one ``/v1/completions`` request and a client-side vote (the
  library's extraction and vote), on a server with consensus drafting;
- ``client-nospec``: the same client on a server without speculative decoding.

One server per configuration per run, all up at once, each at every
``--concurrency`` and ``--max-num-seqs`` (``default``: the flag left out).
The configurations take turns of a few problems per client, in an order
alternating turn by turn and run by run, so a slow minute on this shared
machine falls on all of them.  Each server first answers ``--warmup`` other
problems untimed (consensus drafts from other prompts' paths too: a new
server's acceptance length rose from 2.6 to 5.8 over its first 40 s).  Per
configuration and concurrency: answers/s, tokens and paths per answer,
p50/p95/p99 latency, gold accuracy, the server's CPU seconds beside the
wall, and the ratios to both clients.  ``--merge`` joins runs split across
invocations (``--first-run``) into one table.

Agreement with a full-n vote: the endpoint's stop rule and waves replayed on
``endpoint-full``'s n paths, against their full-n vote (two requests' votes are
no measure: a seed does not repeat a path once drafting is on).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import statistics
import time
from collections import Counter
from pathlib import Path

from ..options import write_json
from .servers import PLUGINS, SERVED, VllmServer, server_args

CONFIGS = ("endpoint", "endpoint-openai", "endpoint-full", "client-drafting", "client-nospec")
BASES = ("client-drafting", "client-nospec")  # what the endpoint's ratios are taken against


def ask(base_url: str, config: str, prob: dict, args) -> dict:
    """One problem, one answer; latency, tokens and the answer (never raises)."""
    import requests

    from consensus_spec.voting.answers import extract_answer
    from consensus_spec.voting.vote import majority_vote

    t0 = time.monotonic()
    body = {"model": SERVED, "prompt": prob["prompt"], "n": args.n, "temperature": 0.8,
            "max_tokens": args.max_tokens, "seed": prob["seed"]}
    full = config == "endpoint-full"
    if config in ("endpoint", "endpoint-full"):  # the native route; the others take the body as is
        body.update(early_stop=not full, return_paths=full)
    if config == "endpoint" and args.schedule:  # a named schedule; endpoint-openai keeps the load's
        body["schedule"] = args.schedule
    route = {"endpoint-openai": "/v1/self_consistency/completions", "endpoint": "/v1/self_consistency",
             "endpoint-full": "/v1/self_consistency"}.get(config, "/v1/completions")
    try:
        r = requests.post(base_url + route, json=body, timeout=args.timeout)
        r.raise_for_status()
        out = r.json()
        if config == "endpoint-openai":
            vote = out["choices"][0]["self_consistency"]
            answer, tokens, paths = vote["answer"], out["usage"]["completion_tokens"], vote["paths_sampled"]
            mode = (vote.get("schedule_used") or {}).get("mode")
        elif config.startswith("endpoint"):
            answer, tokens, paths = out["answer"], out["tokens"], out["paths_sampled"]
            mode = (out.get("schedule_used") or {}).get("mode")
        else:
            answer = majority_vote([extract_answer(c["text"]) for c in out["choices"]]).answer
            tokens, paths, mode = out["usage"]["completion_tokens"], len(out["choices"]), None
        row = {"ok": True, "i": prob["i"], "s": time.monotonic() - t0, "answer": answer,
               "tokens": tokens, "paths": paths, "mode": mode}
        if full:  # the n paths in wave order, for the replayed stop rule
            ordered = sorted(out["paths"], key=lambda x: x["index"])
            row.update(path_answers=[x["answer"] for x in ordered],
                       path_tokens=[x["tokens"] for x in ordered])
        return row
    except Exception as e:  # noqa: BLE001 - counted as a failure in the table
        return {"ok": False, "i": prob["i"], "s": time.monotonic() - t0, "error": repr(e)[:300]}


def run_configs(args, probs: list[dict], run: int, rows: int | None, warm: list[dict] = ()) -> dict:
    """One run at ``rows`` as the module docstring says (servers all up at
    once, warmed, then turns): ``{config: {concurrency: cell}}``."""
    import contextlib

    import requests

    from consensus_spec.model import model_path

    out: dict = {c: {} for c in args.configs}
    with contextlib.ExitStack() as stack:
        servers = {}
        for config in args.configs:
            env = {"VLLM_PLUGINS": PLUGINS} if config.startswith("endpoint") else {}
            if config.startswith("endpoint") and args.run_ahead != "default":
                env["CONSENSUS_SPEC_SC_RUN_AHEAD"] = args.run_ahead
            servers[config] = stack.enter_context(VllmServer(
                server_args(model_path(), config != "client-nospec", rows, args.max_model_len),
                args.log_dir / f"run{run}_{config}_{rows or 'default'}.log", env))
        for server in servers.values():
            server.wait_ready()
        # warm-up, not timed (why: the module docstring), at the highest concurrency
        for config, server in servers.items():
            with cf.ThreadPoolExecutor(max(args.concurrency)) as pool:
                list(pool.map(lambda p: ask(server.base_url, config, p, args),
                              [{**w, "i": -1} for w in warm] or [{**probs[0], "i": -1}]))
        for conc in args.concurrency:
            size = min(len(probs), max(8, 6 * conc))  # a few per client: as loaded as without turns
            for turn, first in enumerate(range(0, len(probs), size)):
                order = args.configs if (run + turn) % 2 == 0 else args.configs[::-1]
                for config in order:
                    server = servers[config]
                    # untimed: a server that sat out the other turns answers its
                    # first request slowly (1.5-2 s against 0.6 s here: this
                    # machine pages an idle process's memory out)
                    ask(server.base_url, config, {**(warm or probs)[turn % len(warm or probs)],
                                                  "i": -1}, args)
                    cpu0, wall0, proc0 = server.cpu_s(), time.monotonic(), time.process_time()
                    with cf.ThreadPoolExecutor(conc) as pool:
                        records = list(pool.map(lambda p: ask(server.base_url, config, p, args),
                                                probs[first:first + size]))
                    cell = out[config].setdefault(conc, {"records": [], "wall_s": 0.0,
                                                         "server_cpu_s": 0.0, "client_cpu_s": 0.0})
                    cell["records"] += records
                    cell["wall_s"] += time.monotonic() - wall0
                    cell["server_cpu_s"] += server.cpu_s() - cpu0
                    cell["client_cpu_s"] += time.process_time() - proc0
            for config, server in servers.items():
                cell = out[config][conc]
                if config.startswith("endpoint"):  # what run-ahead decided and the costs it saw
                    cell["state"] = requests.get(server.base_url + "/v1/self_consistency/state",
                                                 timeout=30).json()
                print(f"  run {run} {config:15s} rows {rows or 'default'} concurrency {conc:3d}: "
                      f"{len(probs) / cell['wall_s']:6.3f} answers/s, wall {cell['wall_s']:6.1f} s, "
                      f"server CPU {cell['server_cpu_s']:6.1f} s", flush=True)
    return out


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def replayed_stop(record: dict, n: int, schedule: str | None = None) -> dict:
    """The endpoint's default stop rule and waves replayed on one
    ``endpoint-full`` answer's n paths: (agrees with their full-n vote,
    paths and tokens the rule would have used)."""
    from consensus_spec.sampling.stopping import StopRule
    from consensus_spec.sampling.waves import Schedule
    from consensus_spec.voting.vote import cluster_answers

    from ..adaptive.stop_rules import replay_order, wave_ends

    ids = cluster_answers(record["path_answers"])
    waves = Schedule.parse(schedule) if schedule else Schedule()
    checks = wave_ends(waves.sizes(n), n) if waves.check == "wave" else list(range(1, n))
    used, tokens, stopped, full = replay_order(ids, record["path_tokens"], StopRule(), checks)
    return {"agree": stopped in full, "paths": used, "tokens": tokens}


def summarize(runs: list[dict], probs: list[dict], args) -> dict:
    """Per configuration and concurrency: means over runs and their spread."""
    from consensus_spec.voting.answers import answers_equal

    table = {}
    for config in args.configs:
        for conc in args.concurrency:
            cells = [r[config][conc] for r in runs if config in r]
            ok = [[x for x in c["records"] if x["ok"]] for c in cells]
            rates = [len(o) / c["wall_s"] for o, c in zip(ok, cells)]
            lat = [x["s"] for o in ok for x in o]
            answers = sum(len(o) for o in ok)
            correct = sum(answers_equal(x["answer"], str(probs[x["i"]]["gold"])) for o in ok for x in o)
            acc = correct / answers if answers else 0.0
            table[(config, conc)] = {
                "config": config, "concurrency": conc, "runs": len(cells),
                "failed": sum(len(c["records"]) for c in cells) - answers,
                "answers_per_s": statistics.fmean(rates) if rates else 0.0,
                "answers_per_s_range": [min(rates), max(rates)] if rates else None,
                "rates": rates,
                "tokens_per_answer": sum(x["tokens"] for o in ok for x in o) / max(1, answers),
                "paths_per_answer": sum(x["paths"] for o in ok for x in o) / max(1, answers),
                "p50_s": _pct(lat, 0.5) if lat else None, "p95_s": _pct(lat, 0.95) if lat else None,
                "p99_s": _pct(lat, 0.99) if lat else None,
                "modes": dict(Counter(x["mode"] for o in ok for x in o if x.get("mode"))),
                "gold_accuracy": acc, "accuracy_se": math.sqrt(acc * (1 - acc) / max(1, answers)),
                "server_cpu_s_per_answer": sum(c["server_cpu_s"] for c in cells) / max(1, answers),
                "wall_s": [round(c["wall_s"], 1) for c in cells],
                "client_cpu_s": [round(c["client_cpu_s"], 1) for c in cells],
            }
    for conc in args.concurrency:  # the stop rule replayed on endpoint-full's own paths
        full = [x for r in runs if "endpoint-full" in r
                for x in r["endpoint-full"][conc]["records"] if x["ok"]]
        for config in ("endpoint", "endpoint-openai"):
            if not full or (config, conc) not in table:
                continue
            replays = [replayed_stop(x, args.n, args.schedule) for x in full]
            table[(config, conc)].update(
                agreement_with_full_n=sum(r["agree"] for r in replays) / len(replays),
                agreement_answers=len(replays),
                replayed_paths_per_answer=statistics.fmean(r["paths"] for r in replays),
                replayed_tokens_frac=sum(r["tokens"] for r in replays)
                / max(1, sum(sum(x["path_tokens"]) for x in full)))
        for name in BASES:
            base = table.get((name, conc))
            key = name.replace("-", "_")
            for config in args.configs:
                row = table[(config, conc)]
                if base and base["answers_per_s"]:
                    row[f"x_answers_per_s_vs_{key}"] = row["answers_per_s"] / base["answers_per_s"]
                    row[f"x_answers_per_s_vs_{key}_per_run"] = [
                        a / b for a, b in zip(row["rates"], base["rates"]) if b]
                    for q in ("p50", "p95"):
                        row[f"x_{q}_vs_{key}"] = row[f"{q}_s"] / base[f"{q}_s"] if base[f"{q}_s"] else None
    return table


def markdown(table: dict, args, rows: int | None) -> str:
    nan = float("nan")
    lines = [f"n={args.n}, {args.problems} problems, max_tokens {args.max_tokens}, "
             f"max_num_seqs {rows or 'default (flag left out)'}, runs {args.runs} "
             "(order alternated); x: over client-drafting / client-nospec (per run, min-max)", "",
             "| config | conc | answers/s (range) | x answers/s | tokens/answer | paths/answer "
             "| p50 / p95 / p99 s | x p50 | x p95 | gold acc (±SE) | agree full-n, replayed "
             "(paths) | server CPU s/answer | schedules | fails |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratios(r, q):
        out = []
        for name in BASES:
            key = f"x_{q}_vs_{name.replace('-', '_')}"
            v = r.get(key)
            per = r.get(key + "_per_run")
            out.append("-" if v is None else f"{v:.2f}" + (f" ({min(per):.2f}-{max(per):.2f})"
                                                            if per and len(per) > 1 else ""))
        return " / ".join(out)

    for (config, conc), r in table.items():
        rng = r["answers_per_s_range"] or [0, 0]
        agree = r.get("agreement_with_full_n")
        agree_text = "-" if agree is None else \
            f"{agree:.3f} of {r['agreement_answers']} ({r['replayed_paths_per_answer']:.1f})"
        modes = ", ".join(f"{m} {c}" for m, c in sorted(r["modes"].items())) or "-"
        lines.append(
            f"| {config} | {conc} | {r['answers_per_s']:.3f} ({rng[0]:.3f}-{rng[1]:.3f}) "
            f"| {ratios(r, 'answers_per_s')} "
            f"| {r['tokens_per_answer']:.0f} | {r['paths_per_answer']:.1f} "
            f"| {r['p50_s'] or nan:.2f} / {r['p95_s'] or nan:.2f} / {r['p99_s'] or nan:.2f} "
            f"| {ratios(r, 'p50')} | {ratios(r, 'p95')} "
            f"| {r['gold_accuracy']:.3f} (±{r['accuracy_se']:.3f}) "
            f"| {agree_text} "
            f"| {r['server_cpu_s_per_answer']:.2f} | {modes} | {r['failed']} |")
    return "\n".join(lines)


def saved_runs(args) -> dict:
    """``--merge``: the files' runs by row limit (None: the flag left out), concurrency
    keys back to ints; ValueError when they lack a configuration or concurrency asked for."""
    runs: dict = {}
    for path in args.merge:
        try:
            saved = json.loads(Path(path).read_text(encoding="utf-8"))["runs"]
            for rows, rr in saved.items():
                runs.setdefault(None if rows == "None" else int(rows), []).extend(
                    {c: {int(k): v for k, v in by.items()} for c, by in r.items()} for r in rr)
        except (OSError, KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"{path}: not a serve-sc --out file ({e})") from None
    missing = [(c, k) for rr in runs.values() for r in rr for c in args.configs
               for k in args.concurrency if k not in r.get(c, {})]
    if missing or not runs:
        raise ValueError(f"the files hold no run of {missing[:1]}: give the flags they ran with")
    args.rows, args.runs = list(runs), len(next(iter(runs.values())))
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals serve-sc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=24, help="test problems per concurrency level")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--concurrency", default="1,8", help="comma list; 8 x n=16 fills 32 rows")
    ap.add_argument("--max-num-seqs", default="32", help="comma list of row limits; 'default': flag left out")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--first-run", type=int, default=0,
                    help="the first run's index (configs alternate order by run), for runs split up")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--run-ahead", default="default", choices=("default", "throughput", "measured", "idle"),
                    help="the endpoint's CONSENSUS_SPEC_SC_RUN_AHEAD (default: unset)")
    ap.add_argument("--schedule", help="a schedule the endpoint config names (endpoint-openai: the load's)")
    ap.add_argument("--warmup", type=int, default=64, help="untimed problems each server answers "
                    "first, at the highest concurrency; 0: one request")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--out", type=Path, help="JSON of every request and the table")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/serve_sc_logs"))
    ap.add_argument("--merge", nargs="+", type=Path, metavar="JSON", help="no server: one table of the "
                    "runs earlier --out files saved; give the flags they ran with")
    args = ap.parse_args(argv)
    try:
        args.rows = [None if r.strip() == "default" else int(r) for r in args.max_num_seqs.split(",")]
    except ValueError:
        ap.error("--max-num-seqs: a comma list of ints or 'default'")
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad or not args.concurrency or min(args.concurrency) < 1 or args.problems < 1 \
            or args.n < 1 or args.n > 64 or args.runs < 1 or args.warmup < 0:
        ap.error(f"configs from {CONFIGS}; concurrency, problems, runs >= 1; 1 <= n <= 64; "
                 "warmup >= 0"
                 + (f" (unknown: {bad})" if bad else ""))
    from consensus_spec.model.synthetic import format_prompt, test_set

    probs = [{"i": i, "prompt": format_prompt(p["question"]), "gold": p["answer"],
              "seed": args.seed + i * 64} for i, p in enumerate(test_set(args.problems + args.warmup))]
    probs, warm = probs[:args.problems], probs[args.problems:]
    print(f"serve-sc: configs {args.configs}, concurrency {args.concurrency}, "
          f"{args.problems} problems, n {args.n}, {args.runs} run(s); cpus {os.cpu_count()}")
    if args.merge:
        try:
            runs = saved_runs(args)
        except ValueError as e:
            ap.error(f"--merge: {e}")
    else:
        runs = {rows: [] for rows in args.rows}
        for run in range(args.first_run, args.first_run + args.runs):
            for rows in args.rows:
                runs[rows].append(run_configs(args, probs, run, rows, warm))
    tables = {rows: summarize(runs[rows], probs, args) for rows in args.rows}
    for rows, table in tables.items():
        print(markdown(table, args, rows))
    if args.out:
        write_json(args.out, {"args": vars(args),  # paths as str, concurrency keys as JSON's str
                              "tables": {str(rows): list(t.values()) for rows, t in tables.items()},
                              "runs": {str(rows): rr for rows, rr in runs.items()}}, default=str)
    return 0 if all(r["failed"] == 0 for t in tables.values() for r in t.values()) else 1
