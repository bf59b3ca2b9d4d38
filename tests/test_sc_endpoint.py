"""``POST /v1/self_consistency`` over HTTP on a real vLLM server (the
embedded model, consensus drafting on, the endpoint plugin loaded through
``VLLM_PLUGINS``), started once for the module and always stopped.

Answers, list prompts, chat messages, early stop with aborts, streaming,
every kind of malformed request (a 4xx naming the field), clients that hang
up (nothing left running in the engine), the per-request in-flight bound,
and a short mixed soak (``python -m tests.sc_soak`` runs the long one)."""

import importlib.util
import json
import logging
import sys
import threading
import time

import pytest
import requests

assert importlib.util.find_spec("vllm") is not None, "vLLM (a declared dependency) is not installed"

from tests import sc_soak, server_soak  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

from tests.conftest import SC_MAX_INFLIGHT as MAX_INFLIGHT  # noqa: E402


@pytest.fixture(scope="module")
def server(sc_server):
    return sc_server  # shared with tests/test_sc_openai.py (tests/conftest.py)


@pytest.fixture(scope="module")
def probs():
    return sc_soak.problems(8)


def test_plugin_loaded_and_said_so(server):
    log = server.log_text()
    assert "Loaded endpoint plugin consensus_spec_self_consistency" in log
    assert "consensus_spec: POST /v1/self_consistency, /v1/self_consistency/completions and " \
           "/v1/self_consistency/chat/completions served (max n 32, 64 problems a request, " \
           f"{MAX_INFLIGHT} paths in flight a request, idle fill oldest, run-ahead throughput, " \
           "step costs measured from the engine's steps)" in log
    assert "is off" not in log and "are not loaded" not in log


def test_single_prompt_answer_agreement_and_paths(server, probs):
    r = sc_soak.post(server.base_url, {"prompt": probs[0]["prompt"], "n": 8, "max_tokens": 96,
                                       "seed": 1, "return_paths": True, "early_stop": False})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "self_consistency" and out["model"] == server_soak.SERVED_NAME
    assert out["early_stop"] == "off" and out["stop_reason"] == "early stop off: all 8 paths"
    assert out["paths_sampled"] == out["paths_finished"] == 8 and out["paths_stopped"] == 0
    assert len(out["paths"]) == 8 and all(p["finish_reason"] in ("stop", "length") for p in out["paths"])
    answers = [p["answer"] for p in out["paths"]]
    assert out["answer"] is not None and out["count"] == answers.count(out["answer"])
    assert out["agreement"] == pytest.approx(out["count"] / sum(a is not None for a in answers), abs=1e-6)
    assert sum(v["count"] for v in out["votes"]) + out["abstained"] == 8
    assert out["tokens"] == sum(p["tokens"] for p in out["paths"]) == out["usage"]["completion_tokens"]
    # the model mostly solves its own test problems; at least its vote is one of its paths
    assert str(out["answer"]) in {str(a) for a in answers}


def test_greedy_requests_repeat(server, probs):
    # seeded sampling did not repeat across requests on this CPU build with drafting: greedy here
    body = {"prompt": probs[1]["prompt"], "n": 6, "max_tokens": 96, "temperature": 0.0,
            "early_stop": False, "return_paths": True}
    a, b = (sc_soak.post(server.base_url, body).json() for _ in range(2))
    assert [p["text"] for p in a["paths"]] == [p["text"] for p in b["paths"]]
    assert a["answer"] == b["answer"]


def test_early_stop_samples_fewer_paths_and_aborts(server, probs):
    """A problem the model agrees on stops after a few waves of 2; a list of
    problems comes back in order, each with its own vote."""
    body = {"prompt": [p["prompt"] for p in probs[:6]], "n": 16, "max_tokens": 96, "seed": 3,
            "early_stop": True}
    r = sc_soak.post(server.base_url, body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["early_stop"] == "bayes(error=0.002)"
    assert out["schedule"] == out["schedule_used"]["schedule"]  # the engine's load chose it
    results = out["results"]
    assert len(results) == 6 and "answer" not in out
    stopped = [x for x in results if x["stopped_early"]]
    assert stopped, results
    for x in stopped:
        assert 0 < x["paths_stopped"] == 16 - x["paths_finished"]
        assert x["paths_sampled"] <= 16 and x["tokens_saved_estimate"] >= 0  # 0: long paths cut
        # the rule after a prefix of paths, or a vote no unfinished path could change
        assert x["stop_reason"].startswith(("bayes(error=0.002): stopped after ",
                                            "bayes(error=0.002): decided after ")), x["stop_reason"]
        assert 0 <= x["paths_ended_in_flight"] <= x["paths_stopped"]
    assert out["usage"]["completion_tokens"] == sum(x["tokens"] for x in results)
    # seeds do not repeat paths once drafting is on, so the votes vary from run to run;
    # the model solves about 56% of its test problems (serve-sc)
    gold = [p["gold"] for p in probs[:6]]
    assert sum(str(x["answer"]) == str(g) for x, g in zip(results, gold)) >= 1
    assert sc_soak.wait_idle(server.base_url)["idle"]


def test_the_engines_load_picks_every_path_at_once_or_waves_and_says_so(server, probs):
    """Nothing else in flight: a problem's 16 paths fit in the batch, so they
    all start (the vote still ends the rest once settled); 9 problems of 16
    paths want more rows than the batch has, so they wave (4, 4, rest while
    9 waves of 4 fit in half the batch).  Each response
    and the state route say which and why; a named schedule is kept."""
    assert sc_soak.wait_idle(server.base_url)["idle"]
    before = sc_soak.endpoint_state(server.base_url)["schedule"]["requests"]
    out = sc_soak.post(server.base_url, {"prompt": probs[0]["prompt"], "n": 16, "max_tokens": 96,
                                         "seed": 5}).json()
    used = out["schedule_used"]
    assert used["mode"] == "all" and out["schedule"] == "all" and used["problems_in_flight"] == 0
    assert used["rows_wanted"] == 16 <= used["max_rows"] and "0 other problems" in used["reason"]
    assert out["paths_sampled"] <= 16 and out["paths_finished"] + out["paths_stopped"] == 16
    many = sc_soak.post(server.base_url, {"prompt": [p["prompt"] for p in probs[:8]]
                                          + [probs[0]["prompt"]], "n": 16, "max_tokens": 64,
                                          "seed": 6}).json()
    few = 9 * 4 <= many["schedule_used"]["max_rows"] // 2  # each wave of 4 fits in half the batch
    assert many["schedule_used"]["mode"] == "waves" and many["schedule"] == ("4,4,rest" if few else "2")
    assert many["schedule_used"]["rows_wanted"] >= 9 * 16 > many["schedule_used"]["max_rows"]
    named = sc_soak.post(server.base_url, {"prompt": probs[1]["prompt"], "n": 4, "max_tokens": 64,
                                           "schedule": "2,rest"}).json()
    assert named["schedule_used"]["mode"] == "requested" and named["schedule"] == "2,rest"
    openai = sc_soak.post(server.base_url, {"prompt": probs[2]["prompt"], "n": 4, "max_tokens": 64},
                          route=sc_soak.COMPLETIONS).json()
    vote = openai["choices"][0]["self_consistency"]
    assert vote["schedule_used"]["mode"] == "all" and vote["schedule"] == "all"
    state = sc_soak.endpoint_state(server.base_url)["schedule"]
    assert state["requests"]["all"] == before.get("all", 0) + 2
    assert state["requests"]["waves"] == before.get("waves", 0) + 1
    assert state["last"]["mode"] == "all" and state["problems_in_flight"] == 0


def test_aborted_paths_tokens_are_counted(server, probs):
    """Idle fill starts later waves beside the first; a first wave that
    agrees stops the problem and aborts them part-way: their tokens (sent by
    vLLM with the abort, the paths being final-output-only) are in ``tokens``."""
    discarded = []
    for i in range(8):
        body = {"prompt": probs[i]["prompt"], "n": 16, "max_tokens": 96, "seed": 11 + i,
                "early_stop": {"kind": "margin", "margin": 2, "min_samples": 1},
                "return_paths": True}
        out = sc_soak.post(server.base_url, body).json()
        assert out["tokens"] == sum(p["tokens"] for p in out["paths"]) + out["tokens_discarded"]
        discarded.append(out["tokens_discarded"])
        if out["tokens_discarded"] > 0:
            break
    assert max(discarded) > 0, discarded


def test_a_rule_that_still_sends_forecast_gets_a_400_naming_it(server, probs):
    """The forecast left the library (an evals experiment now): a request that
    still asks for it is refused with the field named, not run without it."""
    body = {"prompt": probs[1]["prompt"], "n": 16, "max_tokens": 96, "seed": 3}
    for early_stop in ({"kind": "bayes", "forecast": True}, "on+forecast"):
        bad = sc_soak.post(server.base_url, {**body, "early_stop": early_stop})
        assert bad.status_code == 400, bad.text
        err = bad.json()["error"]
        assert err["param"] == "early_stop.forecast" and "evals/adaptive" in err["message"], err


def test_weighted_vote_uses_each_paths_logprobs(server, probs):
    body = {"prompt": probs[3]["prompt"], "n": 6, "max_tokens": 96, "early_stop": False,
            "voting": {"weighted": True}, "return_paths": True}
    r = sc_soak.post(server.base_url, body)
    assert r.status_code == 200, r.text
    out = r.json()
    # final-only outputs still carry the cumulative logprob: every class has a weight
    assert out["votes"] and all(v["weight"] > 0 for v in out["votes"]), out["votes"]
    assert sum(v["count"] for v in out["votes"]) + out["abstained"] == 6


def test_chat_messages_use_the_models_template(server, probs):
    msgs = {"messages": [{"role": "user", "content": probs[0]["question"]}], "n": 2,
            "temperature": 0.0, "max_tokens": 96, "early_stop": False, "return_paths": True}
    plain = {"prompt": probs[0]["prompt"], "n": 2, "temperature": 0.0, "max_tokens": 96,
             "early_stop": False, "return_paths": True}
    a, b = (sc_soak.post(server.base_url, body).json() for body in (msgs, plain))
    # the embedded model's template renders a user turn as its plain prompt
    assert [p["text"] for p in a["paths"]] == [p["text"] for p in b["paths"]]


def test_stream_sends_each_vote_then_the_response(server, probs):
    body = {"prompt": probs[2]["prompt"], "n": 12, "max_tokens": 96, "seed": 5, "stream": True,
            "early_stop": {"kind": "margin", "margin": 2}}
    with requests.post(server.base_url + sc_soak.ROUTE, json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sc_soak.read_stream(r)
    assert events[-1] == "[DONE]"
    final, votes = events[-2], [e for e in events if isinstance(e, dict) and
                                e.get("object") == "self_consistency.vote"]
    assert final["object"] == "self_consistency" and "answer" in final
    assert votes and [v["paths_voted"] for v in votes] == sorted(v["paths_voted"] for v in votes)
    assert votes[-1]["stop"] == final["stopped_early"]
    assert any(e.get("object") == "self_consistency.problem" for e in events if isinstance(e, dict))


@pytest.mark.parametrize("name", sorted(sc_soak.malformed_bodies()))
def test_malformed_request_gets_a_4xx_naming_the_field(server, name):
    res = sc_soak.send_malformed(server.base_url, name, sc_soak.malformed_bodies()[name])
    assert res["ok"], res


def test_client_hang_up_aborts_every_path(server, probs):
    body = {"prompt": [p["prompt"] for p in probs[:3]], "n": 8, "max_tokens": 300,
            "early_stop": False}
    before = sc_soak.endpoint_state(server.base_url)
    for after_s in (0.3, 2.0):
        sc_soak.hang_up(server.base_url, body, after_s, request_id=f"hang-{after_s}")
        idle = sc_soak.wait_idle(server.base_url)
        assert idle["idle"], idle  # nothing runs for a client that left
        assert sc_soak.endpoint_state(server.base_url, f"hang-{after_s}") == {
            "request_id": f"hang-{after_s}", "requests_active": 0, "paths_in_flight": 0}
    after = sc_soak.endpoint_state(server.base_url)
    assert after["requests_total"] >= before["requests_total"] + 1  # they did start
    # 256 paths, 6 at a time: about 9 s here, so a 1 s client timeout always fires
    # (the body above can finish inside 1 s on a quiet machine).
    long_body = {"prompt": [p["prompt"] for p in probs], "n": 32, "max_tokens": 300,
                 "early_stop": False}
    with pytest.raises(requests.Timeout):
        sc_soak.post(server.base_url, long_body, timeout=1.0)  # a client timeout is a hang-up too
    assert sc_soak.wait_idle(server.base_url)["idle"]


def test_one_request_holds_at_most_its_share_of_rows(server, probs):
    body = {"prompt": [p["prompt"] for p in probs[:4]], "n": 8, "max_tokens": 96,
            "early_stop": False}
    seen, mine, done = [], [], threading.Event()

    def watch():
        while not done.is_set():
            seen.append(sc_soak.endpoint_state(server.base_url)["paths_in_flight"])
            mine.append(sc_soak.endpoint_state(server.base_url, "share")["paths_in_flight"])
            time.sleep(0.05)

    t = threading.Thread(target=watch)
    t.start()
    try:
        r = requests.post(server.base_url + sc_soak.ROUTE, json=body,
                          headers={"X-Request-Id": "share"}, timeout=sc_soak.TIMEOUT_S)
    finally:
        done.set()
        t.join()
    assert r.status_code == 200
    assert max(seen) == MAX_INFLIGHT, seen  # filled to the bound, never past it
    assert max(mine) == MAX_INFLIGHT, mine  # the same run, seen by its X-Request-Id


def test_short_mixed_soak_leaves_nothing_behind(server):
    report = sc_soak.soak(server.base_url, 40, threads=4, serial_disconnects=2)
    assert report["good"] > 20 and report["good_ok"] == report["good"], report["good_failures"]
    assert report["malformed"] == 8 and report["malformed_ok"] == 8, report["malformed_failures"]
    assert report["hangups"] > 0 and report["hangups_ended"] == report["hangups"]
    assert report["after_mix"]["idle"], report["after_mix"]
    assert all(s["idle"] for s in report["serial_disconnects"]), report["serial_disconnects"]
    state = report["state_at_end"]
    assert state["requests_active"] == 0 and state["paths_in_flight"] == 0
    assert state["client_ids_held"] == 0 and state["planners_held"] == 0
    assert server.alive() and server.health() == 200
    assert "Traceback" not in server.log_text()


# ---------------------------------------------------------------------------
# Start-up checks, without a server


def test_startup_check_names_what_to_set(monkeypatch):
    from consensus_spec.server import endpoint

    monkeypatch.setitem(sys.modules, "vllm.entrypoints.openai.api_server", sys)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    line = endpoint.startup_check()
    assert line is not None and "VLLM_PLUGINS is not set" in line and endpoint.ENABLE in line
    monkeypatch.setenv("VLLM_PLUGINS", "consensus_spec_vllm_cpu_fixes")
    assert "VLLM_PLUGINS=consensus_spec_vllm_cpu_fixes)" in endpoint.startup_check()
    monkeypatch.setenv("VLLM_PLUGINS", endpoint.ENABLE.split("=", 1)[1])
    assert endpoint.startup_check() is None
    monkeypatch.delitem(sys.modules, "vllm.entrypoints.openai.api_server")
    monkeypatch.delenv("VLLM_PLUGINS")
    assert endpoint.startup_check() is None  # not a server: nothing to say


def test_plugin_without_the_fixes_says_so(monkeypatch):
    from consensus_spec.server import endpoint

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    monkeypatch.setenv("VLLM_PLUGINS", "consensus_spec_self_consistency")
    endpoint.logger.addHandler(handler)
    try:
        plugin = endpoint.plugin()
    finally:
        endpoint.logger.removeHandler(handler)
    assert plugin.name == "consensus_spec_self_consistency" and plugin.required_tasks == ("generate",)
    assert any("vllm-cpu fixes are not loaded" in r.getMessage() for r in records)


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="vllm.endpoint_plugins")
             if e.name == "consensus_spec_self_consistency"]
    assert ep.value == "consensus_spec.server.endpoint:plugin"
    assert json.dumps(ep.load()().required_tasks)


def test_messages_to_a_model_without_a_chat_template_get_a_400():
    from types import SimpleNamespace

    from consensus_spec.server import endpoint
    from consensus_spec.server.options import BadRequest, Limits
    from consensus_spec.server.protocol import parse_request

    class NoTemplate:
        chat_template = None

        def encode(self, text, add_special_tokens=True):
            return [1] * len(text.split())

    engine = SimpleNamespace(renderer=SimpleNamespace(get_tokenizer=NoTemplate))
    st = SimpleNamespace(engine=engine, chat_template=None, max_model_len=512)
    req, *_ = parse_request({"messages": [{"role": "user", "content": "2+2?"}], "n": 2}, Limits())
    with pytest.raises(BadRequest) as e:
        endpoint._render(st, req)
    assert e.value.param == "messages" and "no chat template" in str(e.value)
    req, *_ = parse_request({"prompt": "Question: 2+2?\nAnswer:", "n": 2}, Limits())
    assert endpoint._render(st, req) == [[1, 1, 1]]  # a prompt needs no template


def test_idle_rows_go_to_any_run_or_to_older_runs_first():
    from argparse import Namespace
    from types import SimpleNamespace

    from consensus_spec.sampling.waves import PathPlanner, Schedule
    from consensus_spec.server.options import Limits
    from consensus_spec.server.state import ServerState

    plan = PathPlanner(1, 8, Schedule(waves=(2,), capacity=8), idle_rows=lambda: 0)
    assert len(plan.admit()) == 2 and plan.rows_wanted() == 6  # its unopened paths
    plan = PathPlanner(1, 8, Schedule(waves=(2,), capacity=4), idle_rows=lambda: 0)
    plan.admit()
    assert plan.rows_wanted() == 2  # up to its free capacity
    engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=512,
                                                          get_diff_sampling_param=dict))
    for mode, young in (("any", 20), ("oldest", 20 - 6)):
        st = ServerState(engine, Namespace(), Limits(idle_fill=mode), 32)
        st.runs.update(old=8, young=4)  # 20 rows idle
        st.wants.update(old=lambda: 6, young=lambda: 9)
        assert st.idle_rows("old") == 20 and st.idle_rows("young") == young
        assert st.snapshot()["limits"]["idle_fill"] == mode


def test_every_path_of_a_prompt_goes_to_one_data_parallel_engine():
    """With --data-parallel-size 2, vLLM's balancer would send each path
    wherever; the routes pin a prompt's paths to one engine: the client's
    X-data-parallel-rank header if it is a rank, else the prompt's hash."""
    import asyncio
    from argparse import Namespace
    from types import SimpleNamespace

    from consensus_spec.sampling.routing import data_parallel_rank
    from consensus_spec.server import runs
    from consensus_spec.server.options import Limits, RunOptionsIn, resolve_options
    from consensus_spec.server.state import ServerState

    class Engine:
        model_config = SimpleNamespace(max_model_len=512, get_diff_sampling_param=dict)
        vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=2))

        def __init__(self):
            self.sent = []  # (prompt ids, rank)

        async def generate(self, prompt, params, rid, priority=0, data_parallel_rank=None):
            self.sent.append((tuple(prompt["prompt_token_ids"]), data_parallel_rank))
            await asyncio.sleep(0)
            yield SimpleNamespace(request_id=rid, finished=True, outputs=[SimpleNamespace(
                text="The answer is 4.", token_ids=[7], cumulative_logprob=-1.0, logprobs=None,
                finish_reason="stop", stop_reason=None)])

        async def abort(self, rids):
            pass

    prompts = [{"prompt_token_ids": list(range(p, p + 20))} for p in range(6)]
    opts = resolve_options(RunOptionsIn(early_stop=False), Limits())

    def sent_ranks(headers):
        engine = Engine()
        st = ServerState(engine, Namespace(), Limits(), 32, run_ahead="idle")
        request = SimpleNamespace(headers=headers)
        make = lambda p, k: SimpleNamespace(n=1, logprobs=None, seed=None)  # noqa: E731
        asyncio.run(runs.run_request(st, request, "run", prompts, make, 4, opts, 16))
        assert len(engine.sent) == 6 * 4
        by_prompt: dict = {}
        for ids, rank in engine.sent:
            by_prompt.setdefault(ids, set()).add(rank)
        return {ids: ranks.pop() for ids, ranks in by_prompt.items() if len(ranks) == 1}

    hashed = sent_ranks({})
    assert len(hashed) == 6  # one engine per prompt
    assert all(rank == data_parallel_rank(list(ids), 2) for ids, rank in hashed.items())
    assert set(hashed.values()) == {0, 1}  # distinct prompts spread
    assert set(sent_ranks({"X-data-parallel-rank": "1"}).values()) == {1}
    assert sent_ranks({"X-data-parallel-rank": "7"}) == hashed  # not a rank: not used
