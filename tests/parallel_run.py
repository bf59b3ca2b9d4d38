"""Consensus drafting under vLLM's data and tensor parallelism, on real engines.

    python -m tests.parallel_run dp [--prompts 6] [--n 8] [--out dp.json]
    python -m tests.parallel_run tp [--prompts 20] [--out tp.json]

``dp``: starts vLLM's OpenAI server with ``--data-parallel-size 2`` and
consensus drafting, sends one ``n``-sample completion request per prompt,
first without the ``X-data-parallel-rank`` header (vLLM's load balancer
routes each child on its own) and then, for other prompts, with
``consensus_spec.sampling.routing.rank_headers``. Evidence per engine, two ways:

* ``/metrics``: vLLM labels its counters by engine (``engine="0"``), so the
  change of ``vllm:request_success_total`` and
  ``vllm:spec_decode_num_draft_tokens_total`` per engine over one request
  says where its children ran and which engine drafted for them (requests
  are sent one at a time for that);
* the proposers' own ``counters()`` (``paths_started``, ``num_groups``, ...),
  read in every engine process by the worker extension
  :class:`ConsensusCounters` through the dev-mode ``/collective_rpc``
  endpoint (``VLLM_SERVER_DEV_MODE=1``); with DP, vLLM runs a utility call on
  every engine but answers with engine 0's result only, so each worker also
  writes its counters to ``<dir>/dp<rank>_tp<rank>.json``.

``tp``: greedy outputs of ``LLM(tensor_parallel_size=2)`` with consensus
drafting and without, on the same prompts (each twice, so there are
siblings to draft from), in two subprocesses; they must be token-identical.
``llm.collective_rpc`` reads every TP rank's proposer counters.

Every process started here is stopped before returning (process groups).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

from evals.math.servers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = {"method": "custom_class", "model": "consensus_spec.ConsensusProposer",
        "num_speculative_tokens": 8}
EXTENSION = "tests.parallel_run.ConsensusCounters"
COMMON = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
          "--gpu-memory-utilization", "0.1", "--max-num-seqs", "32", "--seed", "0"]
MAX_TOKENS = 64


class ParallelUnavailable(RuntimeError):
    """The machine cannot start the parallel engine (the message says why)."""


# ---------------------------------------------------------------------------
# Inside vLLM's worker processes
# ---------------------------------------------------------------------------

class ConsensusCounters:
    """vLLM worker extension (``worker_extension_cls``): the proposer's counters
    from inside the worker that owns it. Imports nothing at module level."""

    def consensus_counters(self, directory: str | None = None) -> dict:
        runner = getattr(self, "model_runner", None)
        drafter = getattr(runner, "drafter", None)
        pc = self.vllm_config.parallel_config
        # a dense model's DP engines run as independent DP=1 engines: their
        # data_parallel_rank is 0, data_parallel_index the engine's rank
        dp_rank = getattr(pc, "data_parallel_index", None)
        record = {
            "dp_rank": pc.data_parallel_rank if dp_rank is None else dp_rank,
            "tp_rank": getattr(self, "rank", None),
            "proposer": type(drafter).__name__ if drafter is not None else None,
            "counters": drafter.counters() if hasattr(drafter, "counters") else None,
        }
        if directory:
            path = os.path.join(directory, f"dp{record['dp_rank']}_tp{record['tp_rank']}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(record, f)
            os.replace(path + ".tmp", path)
        return record


# ---------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------

def model_path() -> str:
    from consensus_spec.model import model_path as embedded
    return str(embedded())


def prompts(count: int, offset: int = 0) -> list[str]:
    from consensus_spec.model.synthetic import format_prompt, test_set
    probs = test_set(offset + count)
    return [format_prompt(p["question"]) for p in probs[offset:offset + count]]


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the process group ``proc`` leads (it was started with
    ``start_new_session``), then SIGKILL what is left after ``grace_s``."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # engine processes may outlive the server process itself
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait(10)


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def _error_lines(log: str) -> str:
    lines = [ln for ln in log.splitlines() if re.search(r"Error|error:|ERROR|Traceback", ln)]
    return "\n".join(lines[-8:]) or log[-1500:]


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@contextmanager
def dp_server(dp: int, log_path: str, startup_s: float = 600.0):
    """vLLM's OpenAI server with ``--data-parallel-size dp`` and consensus
    drafting; yields its base URL. Raises :class:`ParallelUnavailable` if it
    does not come up within ``startup_s``."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path(),
           "--host", "127.0.0.1", "--port", str(port), "--data-parallel-size", str(dp),
           "--speculative-config", json.dumps(SPEC), "--worker-extension-cls", EXTENSION, *COMMON]
    extra = {"VLLM_SERVER_DEV_MODE": "1"}
    if dp == 2 and (os.cpu_count() or 1) >= 2:
        extra["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per engine
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(**extra), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise ParallelUnavailable(f"server exited with {proc.returncode}:\n"
                                          + _error_lines(_tail(log_path, 20000)))
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ParallelUnavailable(f"server not healthy after {startup_s:.0f} s:\n"
                                          + _tail(log_path, 1500))
            time.sleep(2)
        yield url
    finally:
        stop_group(proc)


# ---------------------------------------------------------------------------
# Data parallelism (server)
# ---------------------------------------------------------------------------

_PER_ENGINE = {
    "vllm:request_success_total": "requests",
    "vllm:spec_decode_num_draft_tokens_total": "drafted",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}
_LINE = re.compile(r'^(vllm:[a-z_]+)\{([^}]*)\} (\S+)$')


def engine_metrics(url: str) -> dict[str, dict[str, float]]:
    """{engine index: {requests, drafted, accepted}} from ``/metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or m.group(1) not in _PER_ENGINE:
            continue
        engine = re.search(r'engine="([^"]+)"', m.group(2))
        if engine is None:
            continue
        row = out.setdefault(engine.group(1), {v: 0.0 for v in _PER_ENGINE.values()})
        row[_PER_ENGINE[m.group(1)]] += float(m.group(3))  # summed over finished_reason
    return out


def _delta(after: dict, before: dict) -> dict[str, dict[str, int]]:
    return {e: {k: int(round(v - before.get(e, {}).get(k, 0.0))) for k, v in row.items()}
            for e, row in sorted(after.items())}


def _post(url: str, path: str, body: dict, headers: dict | None = None, timeout: float = 600):
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def proposer_counters(url: str, dp: int, directory: str) -> dict[str, dict]:
    """Every engine's proposer counters, keyed by DP rank."""
    for name in os.listdir(directory):
        os.remove(os.path.join(directory, name))
    _post(url, "/collective_rpc", {"method": "consensus_counters", "args": [directory]}, timeout=120)
    deadline = time.monotonic() + 600  # a hang guard: a busy machine is slow, not wrong
    while len(os.listdir(directory)) < dp and time.monotonic() < deadline:
        time.sleep(0.2)  # engines other than 0 answer on their own time
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                rec = json.load(f)
            if rec.get("tp_rank") in (0, None):
                out[str(rec["dp_rank"])] = rec["counters"]
    return out


def _wait_finished(url: str, before: dict, n: int, timeout: float = 600.0) -> dict:
    """Metrics once the ``n`` children's completions have been counted
    (``timeout``: a hang guard, far above the expected wait)."""
    deadline = time.monotonic() + timeout
    while True:
        after = engine_metrics(url)
        done = sum(r["requests"] for r in after.values()) - sum(r["requests"] for r in before.values())
        if done >= n or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def run_dp(num_prompts: int = 6, n: int = 8, dp: int = 2, log_dir: str | None = None) -> dict:
    """One DP server; phase ``default`` (no header) then phase ``pinned``
    (header), on different prompts. Returns per-request per-engine deltas
    and per-phase proposer-counter deltas."""
    from consensus_spec.sampling.routing import data_parallel_rank, rank_headers

    log_dir = log_dir or tempfile.mkdtemp(prefix="dp_run_")
    counters_dir = os.path.join(log_dir, "counters")
    os.makedirs(counters_dir, exist_ok=True)
    texts = prompts(2 * num_prompts)
    result = {"dp": dp, "n": n, "log": os.path.join(log_dir, "server.log"), "phases": {}}
    t0 = time.monotonic()
    with dp_server(dp, result["log"]) as url:
        result["startup_s"] = round(time.monotonic() - t0, 1)
        counters = proposer_counters(url, dp, counters_dir)
        for phase, batch in (("default", texts[:num_prompts]), ("pinned", texts[num_prompts:])):
            requests = []
            for text in batch:
                headers = rank_headers(text, dp) if phase == "pinned" else {}
                before = engine_metrics(url)
                _post(url, "/v1/completions", {"model": model_path(), "prompt": text, "n": n,
                                               "max_tokens": MAX_TOKENS, "temperature": 0.8},
                      headers)
                per_engine = _delta(_wait_finished(url, before, n), before)
                requests.append({"rank": data_parallel_rank(text, dp) if headers else None,
                                 "per_engine": per_engine})
            after = proposer_counters(url, dp, counters_dir)
            keys = ("paths_started", "num_groups", "num_drafted", "num_accepted")
            result["phases"][phase] = {
                "requests": requests,
                "proposer": {e: {k: after[e][k] - counters.get(e, {}).get(k, 0) for k in keys}
                             for e in sorted(after)},
            }
            counters = after
    result["wall_s"] = round(time.monotonic() - t0, 1)
    return result


def check_dp(result: dict) -> list[str]:
    """What is wrong with a :func:`run_dp` result ([] if pinning held)."""
    problems = []
    n = result["n"]
    for phase in ("default", "pinned"):
        for i, req in enumerate(result["phases"][phase]["requests"]):
            ran = {e: row["requests"] for e, row in req["per_engine"].items() if row["requests"]}
            if sum(ran.values()) != n:
                problems.append(f"{phase} request {i}: {sum(ran.values())} of {n} children counted")
            if phase == "pinned":
                drafted_on = {e for e, row in req["per_engine"].items() if row["drafted"]}
                if set(ran) != {str(req["rank"])} or not drafted_on <= {str(req["rank"])}:
                    problems.append(f"pinned request {i} (rank {req['rank']}): children on "
                                    f"{ran}, drafts on engines {sorted(drafted_on)}")
    pinned = result["phases"]["pinned"]
    groups = sum(c["num_groups"] for c in pinned["proposer"].values())
    if groups != len(pinned["requests"]):
        problems.append(f"pinned: {groups} sibling groups over the engines' proposers, "
                        f"expected one per prompt ({len(pinned['requests'])})")
    return problems


# ---------------------------------------------------------------------------
# Tensor parallelism (offline LLM)
# ---------------------------------------------------------------------------

def tp_engine(spec: bool, num_prompts: int, out: str) -> None:
    """One ``LLM(tensor_parallel_size=2)`` run (called in a subprocess)."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # engine core in this process: one process fewer to start (the TP
    # workers are processes either way)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(model_path(), tensor_parallel_size=2, dtype="float32", enforce_eager=True,
              max_model_len=512, gpu_memory_utilization=0.1, seed=0, max_num_seqs=64,
              speculative_config=dict(SPEC) if spec else None,
              worker_extension_cls=EXTENSION, disable_log_stats=False)
    open(out + ".ready", "w").close()  # started: a failure from here on is a real one
    texts = prompts(num_prompts)
    texts = texts + texts  # every prompt twice: greedy siblings to draft from
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    t0 = time.perf_counter()
    outs = llm.generate(texts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    metrics = {m.name: m.value for m in llm.get_metrics()
               if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")}
    result = {"spec": spec, "outputs": [list(o.outputs[0].token_ids) for o in outs],
              "generate_s": wall, "metrics": metrics,
              "ranks": llm.collective_rpc("consensus_counters")}
    with open(out, "w") as f:
        json.dump(result, f)


def run_tp(num_prompts: int = 20, log_dir: str | None = None, timeout_s: float = 900.0,
           concurrent: bool = True) -> dict:
    """Consensus drafting on vs off under TP=2, each engine in its own
    process group (both at once when ``concurrent``: start-up is mostly
    single-threaded imports); every process is stopped on return."""
    log_dir = log_dir or tempfile.mkdtemp(prefix="tp_run_")
    names = ("consensus", "none")
    paths = {name: (os.path.join(log_dir, f"{name}.json"), os.path.join(log_dir, f"{name}.log"))
             for name in names}
    procs: dict[str, subprocess.Popen] = {}
    runs = {}
    t0 = time.monotonic()

    def start(name: str) -> None:
        out, log_path = paths[name]
        cmd = [sys.executable, "-m", "tests.parallel_run", "tp-engine", "--spec", name,
               "--prompts", str(num_prompts), "--out", out]
        with open(log_path, "w") as log:
            procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)

    def finish(name: str) -> None:
        out, log_path = paths[name]
        proc = procs[name]
        try:
            proc.wait(max(1.0, timeout_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            error = ParallelUnavailable if not os.path.exists(out + ".ready") else RuntimeError
            raise error(f"TP=2 engine ({name}) still running after {timeout_s:.0f} s:\n"
                        + _tail(log_path, 1500)) from None
        if proc.returncode != 0 or not os.path.exists(out):
            error = ParallelUnavailable if not os.path.exists(out + ".ready") else RuntimeError
            raise error(f"TP=2 engine ({name}) failed ({proc.returncode}) "
                        + ("before it started" if error is ParallelUnavailable else "while generating")
                        + ":\n" + _error_lines(_tail(log_path, 20000)))
        with open(out) as f:
            runs[name] = json.load(f)
        runs[name]["wall_s"] = round(time.monotonic() - t0, 1)

    try:
        for name in names:
            start(name)
            if not concurrent:
                finish(name)
        if concurrent:
            for name in names:
                finish(name)
    finally:
        for proc in procs.values():
            stop_group(proc)
    spec, plain = runs["consensus"], runs["none"]
    differing = [i for i, (a, b) in enumerate(zip(spec["outputs"], plain["outputs"])) if a != b]
    return {"prompts": num_prompts, "requests": len(spec["outputs"]), "differing": differing,
            "identical": not differing and len(spec["outputs"]) == len(plain["outputs"]),
            "tokens": sum(map(len, spec["outputs"])),
            "spec_metrics": spec["metrics"], "ranks": spec["ranks"],
            "generate_s": {k: round(v["generate_s"], 2) for k, v in runs.items()},
            "wall_s": {k: v["wall_s"] for k, v in runs.items()}, "log_dir": log_dir}


# ---------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.parallel_run", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    dp = sub.add_parser("dp", help="DP=2 server: siblings per engine with and without the header")
    dp.add_argument("--prompts", type=int, default=6)
    dp.add_argument("--n", type=int, default=8)
    tp = sub.add_parser("tp", help="TP=2: greedy consensus drafting vs speculation off")
    tp.add_argument("--prompts", type=int, default=20)
    eng = sub.add_parser("tp-engine", help=argparse.SUPPRESS)
    eng.add_argument("--spec", choices=["consensus", "none"], required=True)
    eng.add_argument("--prompts", type=int, default=20)
    eng.add_argument("--out", required=True)
    for p in (dp, tp):
        p.add_argument("--out", help="write the result JSON here")
        p.add_argument("--log-dir", help="server/engine logs (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.cmd == "tp-engine":
        tp_engine(args.spec == "consensus", args.prompts, args.out)
        return 0
    try:
        if args.cmd == "dp":
            result = run_dp(args.prompts, args.n, log_dir=args.log_dir)
            result["problems"] = check_dp(result)
            ok = not result["problems"]
        else:
            result = run_tp(args.prompts, log_dir=args.log_dir)
            ok = result["identical"]
    except ParallelUnavailable as e:
        print(f"unavailable: {e}", file=sys.stderr)
        return 3
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
