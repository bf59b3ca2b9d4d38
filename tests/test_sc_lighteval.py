"""lighteval on a local task through the self-consistency base URL, as users
run it: ``lighteval endpoint litellm`` (one ``/chat/completions`` request per
problem with ``n``, every choice read as a sample), maj@4 and pass@1 over 4
samples.  On the server tests/conftest.py starts; lighteval runs as a client
from its own venv (``$CONSENSUS_SPEC_VENV-lighteval``, made by .ci/setup:
lighteval 0.13 pins a latex2sympy2_extended that math-verify here cannot use).

A pass-through recorder between the two keeps what went over the wire, so the
metrics lighteval prints are checked against the paths the server returned,
computed here: maj@4 is the majority of the 4 paths' answers (and the
server's own vote), pass@1 the share of correct paths, not a quarter of the
vote's correctness, which is what one voted choice would give it."""

import importlib.util
import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

assert importlib.util.find_spec("vllm") is not None, "vLLM (a declared dependency) is not installed"

from tests import sc_soak, server_soak  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

N = 4  # the task's samples per problem (tests/fixtures/lighteval_sc_task.py)
DOCS = 8
TASK = server_soak.ROOT / "tests" / "fixtures" / "lighteval_sc_task.py"
TASK_NAME = "sc_embedded|0"
MAJ, PASS1 = f"maj@{N}", f"pass@1:n={N}"
RUN_TIMEOUT_S = 600


# lighteval's CLI (its console script's body).  lighteval 0.13 imports every
# built-in task, and its tiny_benchmarks module downloads tinyBenchmarks.pkl
# from GitHub at import, which fails on a closed network: that one request is
# answered 404, which its download() takes as nothing to save; nothing else changes.
LIGHTEVAL_CLI = """
import sys, types, requests
_get = requests.get
def get(url, *args, **kwargs):
    if url.endswith("/tinyBenchmarks.pkl"):
        return types.SimpleNamespace(status_code=404)
    return _get(url, *args, **kwargs)
requests.get = get
from lighteval.__main__ import app
sys.argv[0] = "lighteval"
sys.exit(app())
"""


def lighteval_venv() -> Path:
    """The client venv .ci/setup makes beside the project's own."""
    venv = Path(os.environ.get("CONSENSUS_SPEC_VENV", ".venv").rstrip("/") + "-lighteval")
    return venv if venv.is_absolute() else server_soak.ROOT / venv


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # litellm's client keeps connections open

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        req = urllib.request.Request(self.server.target + self.path, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=RUN_TIMEOUT_S) as res:
                status, data = res.status, res.read()
        except urllib.error.HTTPError as e:
            status, data = e.code, e.read()
        with self.server.lock:
            self.server.exchanges.append({"path": self.path, "request": body,
                                          "status": status, "response": data})
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class Recorder(ThreadingHTTPServer):
    """Forwards every POST to ``target`` and keeps the exchange."""

    daemon_threads = True

    def __init__(self, target: str):
        super().__init__(("127.0.0.1", 0), _Forward)
        self.target, self.exchanges, self.lock = target, [], threading.Lock()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _run_lighteval(tmp_path: Path, base_url: str) -> subprocess.CompletedProcess:
    venv = lighteval_venv()
    python = venv / "bin" / "python"
    assert (venv / "bin" / "lighteval").exists(), \
        f"no lighteval in {venv}: lighteval's venv is made by `bash .ci/setup`"
    model = tmp_path / "model.yaml"  # JSON is YAML
    model.write_text(json.dumps({"model_parameters": {
        "model_name": "openai/" + server_soak.SERVED_NAME, "base_url": base_url + sc_soak.ROUTE,
        "api_key": "-", "concurrent_requests": 4, "max_model_length": server_soak.MAX_MODEL_LEN,
        "api_max_retry": 1, "timeout": 300, "cache_dir": str(tmp_path / "lighteval_cache"),
        "generation_parameters": {"temperature": 1.0, "seed": 1234}}}))
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               CONSENSUS_SPEC_LIGHTEVAL_DATA=str(tmp_path / "data"),
               # nothing from the network: the task's data is local, litellm's
               # model map its bundled copy, no tokenizer is fetched (nltk's
               # punkt download, tried at import and not needed, fails at once)
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"), LITELLM_LOCAL_MODEL_COST_MAP="True",
               TOKENIZERS_PARALLELISM="false", TYPER_STANDARD_TRACEBACK="1")
    # cwd: litellm's response cache (lighteval turns it on) lives there, so
    # every run reaches the server
    return subprocess.run([str(python), "-c", LIGHTEVAL_CLI, "endpoint", "litellm", str(model),
                           TASK_NAME, "--custom-tasks", str(TASK),
                           "--output-dir", str(tmp_path / "out"), "--save-details"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, check=False,
                          timeout=RUN_TIMEOUT_S)


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # children waited for: lighteval
    return usage.ru_utime + usage.ru_stime


def _saved(out: Path) -> tuple[dict, list[dict]]:
    """lighteval's results (the printed metrics) and its per-problem details."""
    import pyarrow.parquet as pq

    (results,) = out.glob("results/**/results_*.json")
    (details,) = out.glob("details/**/details_*.parquet")
    return json.loads(results.read_text())["results"][TASK_NAME], pq.read_table(details).to_pylist()


def test_lighteval_maj_and_pass_at_k_over_the_paths_the_chat_route_returns(sc_server, tmp_path):
    from consensus_spec.model.synthetic import extract_answer, test_set

    problems = test_set(DOCS, seed=77)
    gold = {p["question"]: str(p["answer"]) for p in problems}
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "test.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in gold.items()))
    state0 = sc_soak.endpoint_state(sc_server.base_url)
    recorder = Recorder(sc_server.base_url)
    thread = threading.Thread(target=recorder.serve_forever, daemon=True)
    thread.start()
    t0, cpu0 = time.monotonic(), _children_cpu_s()
    try:
        run = _run_lighteval(tmp_path, recorder.base_url)
    finally:
        recorder.shutdown()
        recorder.server_close()
    wall, cpu = time.monotonic() - t0, _children_cpu_s() - cpu0
    (tmp_path / "exchanges.json").write_text(json.dumps(  # what went over the wire, to read
        [{**x, "request": x["request"].decode(), "response": x["response"].decode()}
         for x in recorder.exchanges], indent=1))
    (tmp_path / "lighteval.log").write_text(run.stdout + run.stderr)
    assert run.returncode == 0, \
        f"lighteval failed ({tmp_path / 'lighteval.log'}):\n{run.stderr[-6000:]}"
    scores, details = _saved(tmp_path / "out")
    print(f"lighteval: {wall:.0f} s wall, {cpu:.0f} s CPU; {MAJ} {scores[MAJ]:.4f}, "
          f"{PASS1} {scores[PASS1]:.4f}")

    # the wire: one chat request per problem asking n=4, 4 choices back, every
    # path run (early stop off), the voted one first
    sent = recorder.exchanges
    assert len(sent) == DOCS and all(x["path"] == sc_soak.CHAT for x in sent)
    paths = {}
    for x in sent:
        assert x["status"] == 200, x["response"][:2000]
        request, choices = json.loads(x["request"]), json.loads(x["response"])["choices"]
        question = request["messages"][-1]["content"]
        assert request["n"] == N and len(choices) == N, (request, len(choices))
        assert [c["index"] for c in choices] == list(range(N))
        votes = [c["self_consistency"] for c in choices]
        assert len({v["representative_path"] for v in votes}) == N  # 4 paths, not 1 four times
        assert all(v["early_stop"] == "off" and v["paths_finished"] == N for v in votes)
        paths[question] = ([c["message"]["content"] for c in choices], votes[0]["answer"])
    assert set(paths) == set(gold)
    state = sc_soak.endpoint_state(sc_server.base_url)
    assert state["requests_total"] - state0["requests_total"] == DOCS
    assert state["requests_unfinished"] == state0["requests_unfinished"]
    assert state["stopping"]["problems"] - state0["stopping"]["problems"] == DOCS
    assert state["stopping"]["stopped_early"] == state0["stopping"]["stopped_early"]

    # lighteval's scores, problem by problem, from those paths
    assert len(details) == DOCS
    maj_right, path_right = [], []
    for d in details:
        question = d["doc"]["query"]
        texts, vote = paths[question]
        assert list(d["model_response"]["text"]) == texts  # lighteval read every choice, in order
        # the model's answer as this project reads it; as the task's normalizer
        # does, a path without one counts as its text
        answers = [str(a) if (a := extract_answer(t)) is not None else t.strip() for t in texts]
        majority = max(answers, key=answers.count)  # ties: the first, the server's voted path
        assert majority == (vote if vote is not None else answers[0]), (answers, vote)
        maj_right.append(float(majority == gold[question]))
        path_right.append(sum(a == gold[question] for a in answers) / N)
        assert d["metric"][MAJ] == maj_right[-1], (question, answers, d["metric"])
        assert d["metric"][PASS1] == pytest.approx(path_right[-1]), (question, answers, d["metric"])
    assert scores[MAJ] == pytest.approx(sum(maj_right) / DOCS)
    assert scores[PASS1] == pytest.approx(sum(path_right) / DOCS)
    # one voted choice read as 4 samples would give pass@1 = maj@4 / 4
    assert scores[PASS1] > 0 and scores[PASS1] != pytest.approx(scores[MAJ] / N)


def test_chat_with_choices_vote_returns_one_early_stopped_vote(sc_server):
    """The route lighteval's maj@n (not pass@k) can also read: choices='vote'."""
    import openai

    client = openai.OpenAI(base_url=sc_server.base_url + sc_soak.ROUTE, api_key="-", max_retries=0,
                           timeout=180)
    question = sc_soak.problems(1, seed=78)[0]["question"]
    out = client.chat.completions.create(model=server_soak.SERVED_NAME, n=N, max_tokens=96,
                                         messages=[{"role": "user", "content": question}],
                                         extra_body={"choices": "vote"})
    assert len(out.choices) == 1
    vote = out.choices[0].model_extra["self_consistency"]
    assert vote["early_stop"] != "off" and 1 <= vote["paths_sampled"] <= N
    assert vote["answer"] is None or vote["answer"] in out.choices[0].message.content
