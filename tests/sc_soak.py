"""The self-consistency routes on a real vLLM OpenAI server: helpers and a soak.

    python -m tests.sc_soak [--requests 1000] [--threads 8] [--out results/sc_soak.json]

Starts the API server on the embedded model with consensus drafting and the
endpoint plugin (``VLLM_PLUGINS`` naming both of this package's plugins),
through :mod:`evals.math.servers`'s ``VllmServer`` (own process group, always
stopped).  The soak sends ``--requests`` requests from ``--threads``
threads, every other one through the OpenAI-shaped routes
(``/v1/self_consistency/completions`` and ``.../chat/completions``), mixing
well-formed ones (single prompts, lists, chat messages, streams), malformed
ones (every kind of :func:`malformed_bodies` and
:func:`malformed_openai_bodies`) and clients that hang up mid-run; then, one at a time, ``--serial-disconnects``
hang-ups each followed by a check that the engine runs nothing.  It counts:
well-formed answered, malformed answered 4xx, the endpoint's live runs and
in-flight paths and the engine's running/waiting requests at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import re
import socket
import sys
import time
import uuid
from pathlib import Path

from evals.math.servers import PLUGINS, VllmServer
from tests import server_soak
from tests.server_soak import SERVED_NAME, checkout_server

ROUTE = "/v1/self_consistency"
TIMEOUT_S = 180.0


def start_server(log_dir: Path, env: dict | None = None, spec: bool = True,
                 extra: list[str] | None = None) -> VllmServer:
    flags = server_soak.server_command(server_soak.model_path(), spec=spec, extra=extra)
    server = checkout_server("sc", flags, Path(log_dir) / "sc_server.log",
                             env={"VLLM_PLUGINS": PLUGINS, **(env or {})})
    return server.start()


COMPLETIONS = ROUTE + "/completions"
CHAT = ROUTE + "/chat/completions"


def post(base_url: str, body, timeout: float = TIMEOUT_S, raw: bool = False, route: str = ROUTE):
    import requests

    if raw:
        return requests.post(base_url + route, data=body,
                             headers={"Content-Type": "application/json"}, timeout=timeout)
    return requests.post(base_url + route, json=body, timeout=timeout)


def endpoint_state(base_url: str, request_id: str | None = None) -> dict:
    """The endpoint's counts; with ``request_id``, of the runs of that X-Request-Id."""
    import requests

    params = {"request_id": request_id} if request_id is not None else None
    return requests.get(base_url + ROUTE + "/state", params=params, timeout=10).json()


def engine_gauges(base_url: str) -> dict:
    """vLLM's running and waiting request gauges (summed over engines)."""
    import requests

    text = requests.get(base_url + "/metrics", timeout=10).text
    out = {"running": 0.0, "waiting": 0.0}
    for line in text.splitlines():
        m = re.match(r"^vllm:num_requests_(running|waiting)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1)] += float(m.group(3))
    return out


def wait_idle(base_url: str, timeout: float = 20.0) -> dict:
    """Poll until the engine runs and queues nothing and the endpoint holds no
    run; returns the last reading with ``idle`` and ``waited_s``."""
    t0 = time.monotonic()
    while True:
        g, s = engine_gauges(base_url), endpoint_state(base_url)
        idle = g["running"] == 0 and g["waiting"] == 0 and s["requests_active"] == 0 \
            and s["paths_in_flight"] == 0
        if idle or time.monotonic() - t0 > timeout:
            return {**g, **{k: s[k] for k in ("requests_active", "paths_in_flight")},
                    "idle": idle, "waited_s": round(time.monotonic() - t0, 2)}
        time.sleep(0.25)


def hang_up(base_url: str, body: dict, after_s: float, request_id: str = "",
            route: str = ROUTE) -> None:
    """A client that sends a request and closes the connection after ``after_s``."""
    host, port = base_url.split("//")[1].split(":")
    data = json.dumps(body).encode()
    rid = f"X-Request-Id: {request_id}\r\n".encode() if request_id else b""
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST " + route.encode() + b" HTTP/1.1\r\nHost: x\r\n" + rid
                  + b"Content-Type: application/json\r\nContent-Length: "
                  + str(len(data)).encode() + b"\r\n\r\n" + data)
        time.sleep(after_s)


def wait_run_ended(base_url: str, request_id: str, timeout: float = 30.0) -> dict:
    """Poll until no run of ``request_id`` is active (its paths aborted)."""
    t0 = time.monotonic()
    while True:
        s = endpoint_state(base_url, request_id)
        ended = s["requests_active"] == 0 and s["paths_in_flight"] == 0
        if ended or time.monotonic() - t0 > timeout:
            return {"ended": ended, "waited_s": round(time.monotonic() - t0, 2)}
        time.sleep(0.1)


def problems(count: int, seed: int = 1234) -> list[dict]:
    from consensus_spec.model.synthetic import format_prompt, test_set

    return [{"prompt": format_prompt(p["question"]), "question": p["question"], "gold": p["answer"]}
            for p in test_set(count, seed=seed)]


def good_body(i: int, probs: list[dict], rng: random.Random) -> dict:
    """Well-formed requests of every shape: single, list, chat, stream, seeded."""
    p = probs[i % len(probs)]
    body = {"model": SERVED_NAME, "prompt": p["prompt"], "n": rng.choice((4, 6, 8)),
            "max_tokens": 80, "seed": rng.randrange(2**20)}
    kind = i % 6
    if kind == 1:
        body["prompt"] = [q["prompt"] for q in probs[i % len(probs):][:3]] or [p["prompt"]]
    elif kind == 2:
        del body["prompt"]
        body["messages"] = [{"role": "user", "content": p["question"]}]
    elif kind == 3:
        body["stream"] = True
    elif kind == 4:
        body.update(early_stop=False, return_paths=True)
    elif kind == 5:
        body.update(early_stop={"kind": "margin", "margin": 2}, schedule="2,2,rest")
    return body


def good_openai_body(i: int, probs: list[dict], rng: random.Random) -> tuple[str, dict]:
    """(route, body): well-formed OpenAI-shaped requests of every shape."""
    p = probs[i % len(probs)]
    body = {"model": SERVED_NAME, "prompt": p["prompt"], "n": rng.choice((4, 6, 8)),
            "max_tokens": 80, "seed": rng.randrange(2**20)}
    kind = i % 5
    if kind == 1:
        body["prompt"] = [q["prompt"] for q in probs[i % len(probs):][:3]] or [p["prompt"]]
    elif kind in (2, 4):
        del body["prompt"]
        body["messages"] = [{"role": "user", "content": p["question"]}]
        body["stream"] = kind == 4
        return CHAT, body
    elif kind == 3:
        body.update(stream=True, stream_options={"include_usage": True})
    return COMPLETIONS, body


def malformed_bodies(model: str = SERVED_NAME) -> dict[str, tuple]:
    """name -> (body (dict, or bytes sent raw), the field the error must name, status)."""
    ok = {"model": model, "prompt": "Question: Mia has 3 apples. How many apples does Mia have?\n"
                                    "Answer:", "n": 4, "max_tokens": 16}
    too_long = "Question: " + " ".join("1 2 3 4 5 6 7 8 9" for _ in range(80)) + "\nAnswer:"
    return {
        "unknown_key": ({**ok, "best_of": 3}, "best_of", 400),
        "n_zero": ({**ok, "n": 0}, "n", 400),
        "n_past_limit": ({**ok, "n": 100_000}, "n", 400),
        "n_string": ({**ok, "n": "eight"}, "n", 400),
        "n_float": ({**ok, "n": 4.5}, "n", 400),
        "temperature_negative": ({**ok, "temperature": -1}, "temperature", 400),
        "top_p_2": ({**ok, "top_p": 2.0}, "top_p", 400),
        "max_tokens_zero": ({**ok, "max_tokens": 0}, "max_tokens", 400),
        "max_tokens_past_context": ({**ok, "max_tokens": 100_000}, "max_tokens", 400),
        "prompt_too_long": ({**ok, "prompt": too_long, "max_tokens": None}, "prompt", 400),
        "prompt_missing": ({"model": model, "n": 4}, "prompt", 400),
        "prompt_and_messages": ({**ok, "messages": [{"role": "user", "content": "x"}]}, "prompt", 400),
        "prompt_list_with_int": ({**ok, "prompt": ["a", 3]}, "prompt.1", 400),
        "too_many_prompts": ({**ok, "prompt": ["a"] * 1000}, "prompt", 400),
        "messages_bad_role": ({"model": model, "messages": [{"role": "robot", "content": "x"}]},
                              "messages.0.role", 400),
        "early_stop_unknown_kind": ({**ok, "early_stop": "sometimes"}, "early_stop", 400),
        "early_stop_bad_error": ({**ok, "early_stop": {"kind": "sequential", "error": 3}},
                                 "early_stop.error", 400),
        "early_stop_unknown_field": ({**ok, "early_stop": {"alpha": 1}}, "early_stop.alpha", 400),
        "schedule_unparseable": ({**ok, "schedule": "two,then,rest"}, "schedule", 400),
        "weighted_with_early_stop": ({**ok, "voting": {"weighted": True}}, "voting.weighted", 400),
        "vote_timeout_huge": ({**ok, "voting": {"timeout_s": 1e9}}, "voting.timeout_s", 400),
        "seed_negative": ({**ok, "seed": -3}, "seed", 400),
        "stop_empty": ({**ok, "stop": [""]}, "stop", 400),
        "unknown_model": ({**ok, "model": "no-such-model"}, "model", 404),
        "non_json": (b"{this is not json", "body", 400),
        "empty_body": (b"", "body", 400),
        "json_array_body": (b"[1, 2, 3]", "body", 400),
    }


def malformed_openai_bodies(model: str = SERVED_NAME) -> dict[str, tuple]:
    """name -> (route, body, the field the error must name, status) for the
    OpenAI-shaped routes."""
    ok = {"model": model, "prompt": "Question: Mia has 3 apples. How many apples does Mia have?\n"
                                    "Answer:", "n": 4, "max_tokens": 16}
    chat = {"model": model, "messages": [{"role": "user", "content": "Mia has 3 apples."}],
            "n": 4, "max_tokens": 16}
    too_long = "Question: " + " ".join("1 2 3 4 5 6 7 8 9" for _ in range(80)) + "\nAnswer:"
    c, h = COMPLETIONS, CHAT
    return {
        "oa_unknown_field": (c, {**ok, "best_of_n": 3}, "best_of_n", 400),
        "oa_n_zero": (c, {**ok, "n": 0}, "n", 400),
        "oa_n_past_limit": (c, {**ok, "n": 100_000}, "n", 400),
        "oa_n_string": (c, {**ok, "n": "eight"}, "n", 400),
        "oa_echo": (c, {**ok, "echo": True}, "echo", 400),
        "oa_beam_search": (c, {**ok, "use_beam_search": True}, "use_beam_search", 400),
        "oa_prompt_logprobs": (c, {**ok, "prompt_logprobs": 1}, "prompt_logprobs", 400),
        "oa_temperature_negative": (c, {**ok, "temperature": -1}, "temperature", 400),
        "oa_max_tokens_past_context": (c, {**ok, "max_tokens": 100_000}, "max_tokens", 400),
        "oa_prompt_too_long": (c, {**ok, "prompt": too_long, "max_tokens": 16}, "prompt", 400),
        "oa_prompt_missing": (c, {"model": model, "n": 4}, "prompt", 400),
        "oa_too_many_prompts": (c, {**ok, "prompt": ["a"] * 1000}, "prompt", 400),
        "oa_stream_options_without_stream": (c, {**ok, "stream_options": {"include_usage": True}},
                                             "stream_options", 400),
        "oa_logprobs_negative": (c, {**ok, "logprobs": -3}, "logprobs", 400),
        "oa_early_stop_unknown_kind": (c, {**ok, "early_stop": "sometimes"}, "early_stop", 400),
        "oa_answer_pattern_bad": (c, {**ok, "answer_pattern": "(unclosed"}, "answer_pattern", 400),
        "oa_answer_pattern_type": (c, {**ok, "answer_pattern": 5}, "answer_pattern", 400),
        "oa_voting_unknown_field": (c, {**ok, "voting": {"weights": 1}}, "voting.weights", 400),
        "oa_seed_string": (c, {**ok, "seed": "x"}, "seed", 400),
        "oa_unknown_model": (c, {**ok, "model": "no-such-model"}, "model", 404),
        "oa_non_json": (c, b"{this is not json", "body", 400),
        "oa_json_array_body": (c, b"[1, 2, 3]", "body", 400),
        "chat_tools": (h, {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]},
                       "tools", 400),
        "chat_messages_missing": (h, {"model": model, "n": 4}, "messages", 400),
        "chat_messages_not_a_list": (h, {**chat, "messages": "hello"}, "messages", 400),
        "chat_n_past_limit": (h, {**chat, "n": 100_000}, "n", 400),
        "chat_top_logprobs_without_logprobs": (h, {**chat, "top_logprobs": 2}, "top_logprobs", 400),
        "chat_unknown_field": (h, {**chat, "early_stopping": True}, "early_stopping", 400),
    }


def send_malformed(base_url: str, name: str, spec: tuple) -> dict:
    route, (body, field, status) = (spec[0], spec[1:]) if len(spec) == 4 else (ROUTE, spec)
    try:
        r = post(base_url, body, timeout=60, raw=isinstance(body, bytes), route=route)
        error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith(
            "application/json") else {}
        ok = r.status_code == status and error.get("param") == field and field in error.get("message", "")
        return {"name": name, "status": r.status_code, "ok": ok, "error": error}
    except Exception as e:  # noqa: BLE001 - recorded
        return {"name": name, "status": None, "ok": False, "error": f"{type(e).__name__}: {e}"}


def read_stream(r) -> list:
    events = []
    for line in r.iter_lines(decode_unicode=True):
        if line and line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _openai_votes(events: list) -> tuple[list, dict]:
    """The votes (by choice index) and the usage of an OpenAI-shaped stream."""
    votes, usage = {}, {}
    for e in events:
        if isinstance(e, dict):
            usage = e.get("usage") or usage
            for c in e.get("choices", []):
                if "self_consistency" in c:
                    votes[c["index"]] = c["self_consistency"]
    return [votes[i] for i in sorted(votes)], usage


def send_good(base_url: str, body: dict, route: str = ROUTE) -> dict:
    t0 = time.monotonic()
    try:
        if body.get("stream"):
            import requests
            with requests.post(base_url + route, json=body, stream=True, timeout=TIMEOUT_S) as r:
                events = read_stream(r) if r.status_code == 200 else []
                status = r.status_code
        else:
            r = post(base_url, body, route=route)
            status, events = r.status_code, [r.json(), "[DONE]"]
        count = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
        every = body.get("choices") == "paths" or (  # n choices a prompt, each with the vote
            route.endswith("/chat/completions") and body.get("n", 1) > 1 and body.get("choices") != "vote")
        if every:
            count *= body.get("n", 1)
        if route == ROUTE:
            final = events[-2] if len(events) >= 2 and events[-1] == "[DONE]" else {}
            votes, usage = (final.get("results", [final]) if final else []), final.get("usage", {})
        else:
            votes, usage = _openai_votes(events)
        ok = status == 200 and events[-1:] == ["[DONE]"] and len(votes) == count \
            and all("agreement" in v for v in votes)
        return {"ok": ok, "status": status, "s": time.monotonic() - t0,
                "tokens": usage.get("completion_tokens")}
    except Exception as e:  # noqa: BLE001 - recorded
        return {"ok": False, "status": None, "error": f"{type(e).__name__}: {e}"[:300]}


def soak(base_url: str, requests_: int, threads: int, malformed_every: int = 5,
         disconnect_every: int = 7, serial_disconnects: int = 3, seed: int = 0) -> dict:
    """The mixed soak against a running server (see the module docstring)."""
    rng = random.Random(seed)
    probs = problems(64)
    bad = {**malformed_bodies(), **malformed_openai_bodies()}
    bad_names = sorted(bad)
    plan = []
    for i in range(requests_):
        openai_shaped = i % 2 == 1  # every other request through the OpenAI-shaped routes
        if i % malformed_every == malformed_every - 1:
            plan.append(("bad", bad_names[(i // malformed_every) % len(bad_names)]))
        elif i % disconnect_every == disconnect_every - 1:
            route, body = good_openai_body(i, probs, rng) if openai_shaped \
                else (ROUTE, good_body(i, probs, rng))
            body = {**body, "early_stop": False, "n": 8, "max_tokens": 200, "stream": False}
            body.pop("stream_options", None)
            plan.append(("hangup", (route, body)))
        elif openai_shaped:
            plan.append(("good", good_openai_body(i, probs, rng)))
        else:
            plan.append(("good", (ROUTE, good_body(i, probs, rng))))

    def one(item):
        kind, x = item
        if kind == "bad":
            return kind, send_malformed(base_url, x, bad[x])
        if kind == "hangup":
            rid = f"soak-hangup-{uuid.uuid4().hex[:12]}"
            route, body = x
            hang_up(base_url, body, after_s=rng.uniform(0.05, 1.0), request_id=rid, route=route)
            return kind, {**wait_run_ended(base_url, rid), "route": route}  # its paths aborted
        route, body = x
        return kind, {**send_good(base_url, body, route), "route": route}

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(one, plan))
    wall = time.monotonic() - t0
    after_mix = wait_idle(base_url)
    serial = []
    for i in range(serial_disconnects):
        body = {**good_body(i, probs, rng), "early_stop": False, "n": 8, "max_tokens": 200,
                "stream": False}
        body.pop("messages", None)
        body["prompt"] = probs[i]["prompt"]
        route = COMPLETIONS if i % 2 else ROUTE
        hang_up(base_url, body, after_s=1.5, route=route)
        serial.append({**wait_idle(base_url), "route": route})
    good = [r for k, r in results if k == "good"]
    malformed = [r for k, r in results if k == "bad"]
    return {
        "requests": requests_, "threads": threads, "wall_s": round(wall, 1),
        "good": len(good), "good_ok": sum(r["ok"] for r in good),
        "good_by_route": {rt: sum(r["route"] == rt for r in good) for rt in (ROUTE, COMPLETIONS, CHAT)},
        "good_failures": [r for r in good if not r["ok"]][:5],
        "malformed": len(malformed), "malformed_ok": sum(r["ok"] for r in malformed),
        "malformed_statuses": sorted({(r["name"], r["status"]) for r in malformed}),
        "malformed_failures": [r for r in malformed if not r["ok"]][:5],
        "hangups": sum(k == "hangup" for k, _ in results),
        "hangups_by_route": {rt: sum(k == "hangup" and r["route"] == rt for k, r in results)
                             for rt in (ROUTE, COMPLETIONS, CHAT)},
        "hangups_ended": sum(r["ended"] for k, r in results if k == "hangup"),
        "hangup_end_wait_s_max": max([r["waited_s"] for k, r in results if k == "hangup"],
                                     default=None),
        "after_mix": after_mix, "serial_disconnects": serial,
        "state_at_end": endpoint_state(base_url),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.sc_soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--serial-disconnects", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/sc_soak"))
    args = ap.parse_args(argv)
    server = start_server(args.log_dir)
    try:
        server.wait_ready()
        rss_before = server_soak.tree_rss_mb(server.proc.pid)[0]
        report = soak(server.base_url, args.requests, args.threads,
                      serial_disconnects=args.serial_disconnects)
        report["rss_mb"] = {"before": round(rss_before), "after": round(server_soak.tree_rss_mb(
            server.proc.pid)[0])}
        report["alive_at_end"] = server.alive() and server.health() == 200
    finally:
        server.stop()
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    ok = report["good_ok"] == report["good"] and report["malformed_ok"] == report["malformed"] \
        and report["hangups_ended"] == report["hangups"] \
        and report["after_mix"]["idle"] and all(s["idle"] for s in report["serial_disconnects"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
