"""A week of traffic, compressed: the request plan of :mod:`tests.memory_soak`.

:func:`plan` makes ``count`` requests for a server with consensus drafting
and the self-consistency routes, every 500 of them the same mix of shapes
in a shuffled order (so any two windows of 500 or 1,000 requests are alike
and their latencies comparable), each with its own prompt and seed:

- ``/v1/completions`` with ``n=16`` (one in five streamed);
- ``POST /v1/self_consistency``: single prompts, lists, chat messages,
  streams, early stop off with the paths returned, margin rules with a schedule;
- ``/v1/self_consistency/completions`` and ``.../chat/completions``, with
  and without ``stream`` (usage included or not), list prompts;
- ``n`` of 4-16, ``max_tokens`` of 32-128, a ``seed`` on three in five;
- prompts: three in four never seen before, one in four from a few hot
  ones (a Zipf draw: a client resending its problems);
- malformed bodies (every kind :mod:`tests.sc_soak` and
  :mod:`tests.server_soak` know), about one in eight;
- clients that hang up mid-request (streamed or not), one in ten;
- bursts of 10-80 requests at 2-12 at once, then idle gaps of 0.2-3 s;
  a burst never spans a multiple of ``segment`` (250), where the soak samples.

:func:`plain_equivalent` turns a request into the nearest one a plain vLLM
server (no plugin, no speculation) has: a self-consistency request becomes
``/v1/completions`` (a prompt, or a list) or ``/v1/chat/completions``
(messages) with the same ``n``, ``max_tokens``, ``seed``, ``temperature``
and ``stream``, the vote's own fields dropped: what a client voting by
itself would send.  It asks for all ``n`` paths, where early stop may
sample fewer.  A malformed body becomes a malformed ``/v1/completions``
body of vLLM's (the same count, none of the self-consistency fields);
a hang-up stays a hang-up on the equivalent request.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from tests.sc_soak import CHAT, COMPLETIONS, ROUTE, malformed_bodies, malformed_openai_bodies
from tests.server_soak import SERVED_NAME, malformed_requests

V1_COMPLETIONS = "/v1/completions"
V1_CHAT = "/v1/chat/completions"
PERIOD = 500  # the mix of shapes repeats every PERIOD requests
SEGMENT = 250  # bursts end at multiples of this (the soak samples there)
HOT_PROMPTS = 24
SC_ONLY = ("early_stop", "schedule", "voting", "return_paths", "answer_pattern")

# shapes per PERIOD: (kind, route, how many)
MIX = (("good", V1_COMPLETIONS, 110), ("good", ROUTE, 110), ("good", COMPLETIONS, 100),
       ("good", CHAT, 70), ("bad", None, 60),
       ("hangup", V1_COMPLETIONS, 10), ("hangup", ROUTE, 15), ("hangup", COMPLETIONS, 15),
       ("hangup", CHAT, 10))
assert sum(m[2] for m in MIX) == PERIOD


@dataclass
class Item:
    index: int
    kind: str  # "good", "bad" or "hangup"
    route: str
    body: dict | bytes
    field: str | None = None  # bad: the field the error must name (None: any 4xx)
    status: int | None = None  # bad: the status it must get (None: any 4xx)
    hangup_after: float = 0.0  # hangup: seconds into the run (or the send) before closing
    name: str = ""  # bad: the malformed kind


@dataclass
class Burst:
    items: list[Item]
    concurrency: int
    gap_after_s: float
    segment_end: bool = False  # the last burst before a sample point
    extra: dict = field(default_factory=dict)


def _prompts(count: int, seed: int):
    """An endless-enough stream of prompts: mostly new, some hot."""
    from consensus_spec.model.synthetic import format_prompt, generate_problems

    rng = random.Random(seed + 1)
    fresh = generate_problems(count, seed=seed)
    hot = fresh[:HOT_PROMPTS]
    weights = [1.0 / (i + 1) for i in range(HOT_PROMPTS)]
    new = iter(fresh[HOT_PROMPTS:])

    def take() -> dict:
        p = rng.choices(hot, weights)[0] if rng.random() < 0.25 else next(new, None)
        if p is None:  # ran out of new ones: hot ones from here on
            p = rng.choices(hot, weights)[0]
        return {"prompt": format_prompt(p["question"]), "question": p["question"]}
    return take


def _good(route: str, take, rng: random.Random, seeds: random.Random) -> dict:
    """``rng`` draws the shape (the same every period), ``seeds`` the seed."""
    p = take()
    body = {"model": SERVED_NAME, "max_tokens": rng.choice((32, 48, 64, 96, 128)),
            "temperature": 0.8}
    if rng.random() < 0.6:
        body["seed"] = seeds.randrange(2**20)
    if route == V1_COMPLETIONS:
        return {**body, "prompt": p["prompt"], "n": 16, "stream": rng.random() < 0.2}
    body["n"] = rng.choice((4, 6, 8, 12, 16))
    if route == CHAT:
        return {**body, "messages": [{"role": "user", "content": p["question"]}],
                "stream": rng.random() < 0.5}
    shape = rng.randrange(6)
    if shape == 1:  # a list of problems
        body["prompt"] = [p["prompt"]] + [take()["prompt"] for _ in range(rng.choice((1, 2)))]
    elif shape == 2 and route == ROUTE:
        body["messages"] = [{"role": "user", "content": p["question"]}]
    else:
        body["prompt"] = p["prompt"]
    body["stream"] = shape in (3, 4) or (route == COMPLETIONS and shape == 5)
    if route == ROUTE and shape == 4:
        body.update(early_stop=False, return_paths=True)
    elif route == ROUTE and shape == 5:
        body.update(early_stop={"kind": "margin", "margin": 2}, schedule="2,2,rest")
    elif route == COMPLETIONS and body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return body


def _hangup(route: str, take, rng: random.Random, seeds: random.Random) -> dict:
    """A request long enough to be left mid-way: all paths, 256 tokens."""
    body = _good(route, take, rng, seeds)
    body.update(max_tokens=256, n=16 if route == V1_COMPLETIONS else rng.choice((8, 12, 16)))
    body.pop("stream_options", None)
    if isinstance(body.get("prompt"), list):
        body["prompt"] = body["prompt"][0]
    if route != V1_COMPLETIONS:
        body.update(early_stop=False)
        body.pop("return_paths", None)
        body.pop("schedule", None)
    return body


def _malformed() -> list[tuple[str, str, object, str | None, int | None]]:
    """(name, route, body, field, status): every malformed kind, ours naming the field."""
    out = [(name, ROUTE, body, fld, status)
           for name, (body, fld, status) in malformed_bodies().items()]
    out += [(name, route, body, fld, status)
            for name, (route, body, fld, status) in malformed_openai_bodies().items()]
    out += [("v1_" + name, V1_COMPLETIONS, spec["body"] if spec["body"] is not None else b"",
             None, None) for name, spec in malformed_requests().items()]
    return out


def plan(count: int, seed: int = 0) -> list[Burst]:
    """The requests, in bursts (see the module docstring)."""
    seeds = random.Random(seed)
    take = _prompts(count * 2 + HOT_PROMPTS + 10, seed)
    shapes = [(kind, route) for kind, route, k in MIX for _ in range(k)]
    bad = _malformed()
    items: list[Item] = []
    for start in range(0, count, PERIOD):
        rng = random.Random(seed * 7919 + 1)  # the same shapes in the same order every period
        order = list(shapes)
        rng.shuffle(order)
        for kind, route in order[:count - start]:
            i = len(items)
            if kind == "bad":
                name, route_, body, fld, status = bad[i % len(bad)]
                items.append(Item(i, kind, route_, body, fld, status, name=name))
            elif kind == "hangup":
                items.append(Item(i, kind, route, _hangup(route, take, rng, seeds),
                                  hangup_after=round(rng.uniform(0.02, 0.4), 2)))
            else:
                items.append(Item(i, kind, route, _good(route, take, rng, seeds)))
    bursts: list[Burst] = []
    burst_rng = random.Random(seed * 31 + 7)  # burst shapes repeat every period too
    i = 0
    while i < len(items):
        if i % PERIOD == 0:
            burst_rng.seed(seed * 31 + 7)
        seg_end = min(len(items), (i // SEGMENT + 1) * SEGMENT)
        size = min(burst_rng.randint(10, 80), seg_end - i)
        bursts.append(Burst(items[i:i + size], burst_rng.choice((2, 4, 8, 8, 12)),
                            round(burst_rng.uniform(0.2, 3.0), 2), i + size == seg_end))
        i += size
    return bursts


def plain_equivalent(item: Item) -> Item:
    """The nearest request a plain vLLM server has (see the module docstring)."""
    if item.kind == "bad":
        if item.route == V1_COMPLETIONS:
            return item
        kinds = [b for b in _malformed() if b[1] == V1_COMPLETIONS]
        name, route, body, _, _ = kinds[item.index % len(kinds)]
        return replace(item, route=route, body=body, field=None, status=None, name=name)
    if item.route == V1_COMPLETIONS:
        return item
    body = {k: v for k, v in item.body.items() if k not in SC_ONLY}
    route = V1_CHAT if "messages" in body else V1_COMPLETIONS
    return replace(item, route=route, body=body)


def count_items(bursts: list[Burst]) -> int:
    return sum(len(b.items) for b in bursts)
