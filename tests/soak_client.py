"""The client side of :mod:`tests.memory_soak`: send one planned request
(:class:`tests.week_traffic.Item`) and judge the answer, never raising.

- good: a 200 with every choice (or every problem's vote) there, streamed or not;
- bad: a 4xx; where the plan names a field (this package's routes), the
  error's ``param`` is that field and its message names it;
- hang-up: a raw socket that sends the request and closes after a while.
  On this package's routes (``check``) the request carries an
  ``X-Request-Id``; its run is seen active before the close, and the time
  from the close until ``GET /v1/self_consistency/state?request_id=``
  shows none of its runs or paths is measured.  vLLM's own routes say
  nothing of one request: their hang-ups are checked one at a time at the
  end (:func:`serial_hangup`, the engine's running and waiting gauges).
"""

from __future__ import annotations

import json
import re
import socket
import time
import uuid

from tests.sc_soak import ROUTE, endpoint_state, engine_gauges, read_stream, send_good
from tests.week_traffic import V1_CHAT, V1_COMPLETIONS, Item

TIMEOUT_S = 300.0  # one good request, under a burst of 12 on two cores
BAD_TIMEOUT_S = 60.0
POLL_S = 0.05
END_WAIT_S = 10.0  # how long a hang-up's run is waited for (the target is 1 s)
SERIAL_TRIES = 3  # one-at-a-time hang-ups: sends of a run that ends before it is seen


def send(base_url: str, item: Item, check_hangups: bool) -> dict:
    t0 = time.monotonic()
    try:
        if item.kind == "bad":
            out = _bad(base_url, item)
        elif item.kind == "hangup":
            out = hang_up(base_url, item, check_hangups and item.route.startswith(ROUTE))
        elif item.route in (V1_COMPLETIONS, V1_CHAT):
            out = _good_vllm(base_url, item)
        else:
            out = send_good(base_url, item.body, item.route)
    except Exception as e:  # noqa: BLE001 - recorded, judged by the checks
        out = {"ok": False, "status": None, "error": f"{type(e).__name__}: {e}"[:300]}
    out.setdefault("s", time.monotonic() - t0)
    return out


def _good_vllm(base_url: str, item: Item) -> dict:
    """vLLM's /v1/completions or /v1/chat/completions: every choice finished."""
    import requests

    body = item.body
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    want = set(range(body.get("n", 1) * prompts))
    t0 = time.monotonic()
    if body.get("stream"):
        with requests.post(base_url + item.route, json=body, stream=True, timeout=TIMEOUT_S) as r:
            events = read_stream(r) if r.status_code == 200 else []
            status = r.status_code
        done = {c["index"] for e in events if isinstance(e, dict)
                for c in e.get("choices", []) if c.get("finish_reason")}
        ok = status == 200 and events[-1:] == ["[DONE]"] and done == want
        return {"ok": ok, "status": status, "s": time.monotonic() - t0, "tokens": None}
    r = requests.post(base_url + item.route, json=body, timeout=TIMEOUT_S)
    out = r.json() if r.status_code == 200 else {}
    done = {c["index"] for c in out.get("choices", []) if c.get("finish_reason")}
    return {"ok": r.status_code == 200 and done == want, "status": r.status_code,
            "s": time.monotonic() - t0, "tokens": (out.get("usage") or {}).get("completion_tokens")}


def _bad(base_url: str, item: Item) -> dict:
    import requests

    raw = isinstance(item.body, bytes)
    r = requests.post(base_url + item.route, data=item.body if raw else None,
                      json=None if raw else item.body,
                      headers={"Content-Type": "application/json"} if raw else None,
                      timeout=BAD_TIMEOUT_S)
    try:
        error = r.json().get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    error = error if isinstance(error, dict) else {"message": str(error)}
    ok = 400 <= r.status_code < 500 and (item.status is None or r.status_code == item.status)
    if item.field is not None:
        ok = ok and error.get("param") == item.field and item.field in str(error.get("message"))
    return {"ok": ok, "status": r.status_code, "name": item.name,
            "param": error.get("param")}


def _request_bytes(route: str, body: dict, request_id: str) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Request-Id: {request_id}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


def _received(sock) -> bytes:
    """What the server has sent so far, left unread (without waiting)."""
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16, socket.MSG_PEEK)
    except OSError:
        return b""
    finally:
        sock.setblocking(True)


def _answered(head: bytes, stream: bool) -> bool:
    """A whole answer (a stream's headers come at once; its end is [DONE])."""
    return b"data: [DONE]" in head if stream else head.startswith(b"HTTP/1.1 ")


def hang_up(base_url: str, item: Item, check: bool) -> dict:
    """Send ``item`` and close the connection ``item.hangup_after`` seconds
    into its run (``check``: its run seen active first; then the time until
    its run and paths are gone)."""
    host, port = base_url.split("//")[1].split(":")
    rid = f"soak-hangup-{uuid.uuid4().hex[:12]}"
    out: dict = {"ok": True, "status": None, "route": item.route, "checked": check}
    stream = bool(item.body.get("stream"))
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(_request_bytes(item.route, item.body, rid))
        if check:
            deadline = time.monotonic() + 30.0
            seen = False
            while not seen and time.monotonic() < deadline:
                seen = endpoint_state(base_url, rid)["requests_active"] > 0
                if not seen and _answered(_received(sock), stream):
                    break  # answered already (or refused)
                if not seen:
                    time.sleep(POLL_S)
            out["seen_active"] = seen
        time.sleep(item.hangup_after)
        if check:
            s = endpoint_state(base_url, rid)
            out["finished_before_close"] = s["requests_active"] == 0
        head = _received(sock)
        m = re.match(rb"HTTP/1\.1 (\d{3})", head)
        out["status"] = int(m.group(1)) if m else None
        answered = _answered(head, stream)
    closed = time.monotonic()
    if not check:
        return out
    while True:
        s = endpoint_state(base_url, rid)
        ended = s["requests_active"] == 0 and s["paths_in_flight"] == 0
        if ended or time.monotonic() - closed > END_WAIT_S:
            break
        time.sleep(POLL_S)
    out.update(ended=ended, end_s=round(time.monotonic() - closed, 3))
    # a run over before the first poll answered (a short one, a busy loop) was
    # answered in full: no hang-up, and nothing to end
    out["answered_before_close"] = not out["seen_active"] and answered and out["status"] == 200
    out["ok"] = bool((out["seen_active"] or out["answered_before_close"]) and ended)
    return out


def wait_idle(base_url: str, endpoint: bool, timeout: float = 60.0) -> dict:
    """Poll until the engine runs and queues nothing (and, ``endpoint``, the
    self-consistency routes hold no run); the last reading, ``idle``, ``waited_s``."""
    t0 = time.monotonic()
    while True:
        g = engine_gauges(base_url)
        s = endpoint_state(base_url) if endpoint else {"requests_active": 0, "paths_in_flight": 0}
        idle = g["running"] == 0 and g["waiting"] == 0 and s["requests_active"] == 0 \
            and s["paths_in_flight"] == 0
        if idle or time.monotonic() - t0 > timeout:
            return {**g, "requests_active": s["requests_active"],
                    "paths_in_flight": s["paths_in_flight"], "idle": idle,
                    "waited_s": round(time.monotonic() - t0, 2)}
        time.sleep(0.1)


def serial_hangup(base_url: str, item: Item, endpoint: bool) -> dict:
    """``item`` alone on an idle server, hung up on mid-run: the time from
    the close until vLLM's gauges (and the endpoint) show nothing running.
    On this package's routes the run is seen active through its
    ``X-Request-Id``; vLLM's routes are sent streamed and left after their
    first chunk (a running request: the gauges, scraped, can miss a short one)."""
    import requests

    before = wait_idle(base_url, endpoint)
    if item.route.startswith(ROUTE):
        host, port = base_url.split("//")[1].split(":")
        stream = bool(item.body.get("stream"))
        for _ in range(SERIAL_TRIES):  # a run answered before a poll saw it is sent again
            rid = f"soak-serial-{uuid.uuid4().hex[:8]}"
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(_request_bytes(item.route, item.body, rid))
                deadline, ran, answered = time.monotonic() + 30.0, False, False
                while not ran and not answered and time.monotonic() < deadline:
                    ran = endpoint_state(base_url, rid)["requests_active"] > 0
                    answered = not ran and _answered(_received(sock), stream)
                    time.sleep(POLL_S)
                if ran:
                    time.sleep(0.1)
            if ran:
                break
            wait_idle(base_url, endpoint)
    else:
        with requests.post(base_url + item.route, json={**item.body, "stream": True},
                           stream=True, timeout=TIMEOUT_S) as r:
            ran = r.status_code == 200 and any(
                line.startswith(b"data: ") for line in r.iter_lines(chunk_size=1) if line)
    closed = time.monotonic()
    while True:
        after = wait_idle(base_url, endpoint, timeout=0.0)
        if after["idle"] or time.monotonic() - closed > END_WAIT_S:
            break
        time.sleep(POLL_S)
    return {"route": item.route, "idle_before": before["idle"], "ran": ran,
            "idle_after": after["idle"], "end_s": round(time.monotonic() - closed, 3)}
