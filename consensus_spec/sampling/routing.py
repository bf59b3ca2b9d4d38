"""Keep a prompt's sibling paths on one data-parallel engine.

Consensus drafting drafts each path from its siblings, the other samples of
the same prompt, and a proposer only sees the requests of its own engine. vLLM
fans an ``n > 1`` request out into ``n`` child requests in the front end, and
with ``data_parallel_size > 1`` its load balancer routes every child on its
own (a burst goes round-robin), so each engine holds a fraction of a
problem's siblings and drafts less. Pinning every request of a prompt to
``data_parallel_rank(prompt, size)`` keeps the siblings together, and
repeated submissions of the prompt land on the engine whose prefix cache
already holds it.

* Server: send the rank in the ``X-data-parallel-rank`` header
  (:data:`DP_RANK_HEADER`); vLLM's OpenAI server copies it onto the request
  and every child of an ``n > 1`` request inherits it.
  :func:`rank_headers` builds the header for ``openai``'s ``extra_headers``.
* ``AsyncLLM``: ``generate(..., data_parallel_rank=data_parallel_rank(p, size))``.
* Offline multi-process DP (one ``LLM`` per rank): give every process the
  problems of its rank, :func:`shard`.
* ``LLMEngine.add_request`` (what ``vllm.LLM`` and ``self_consistency`` drive)
  has no rank argument in vLLM 0.32 and fronts one engine core;
  :func:`request_pinning` passes the rank where an engine takes one.

The hash is stable across processes, machines and Python versions (BLAKE2b,
not the salted ``hash()``), and the rank comes from a jump consistent hash:
ranks are spread evenly, and going from ``D`` to ``D + 1`` engines moves only
about ``1 / (D + 1)`` of the prompts. Pure Python; no vLLM import.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import struct
from typing import Any, Callable, Iterable, Sequence

__all__ = [
    "DP_RANK_HEADER",
    "data_parallel_rank",
    "engine_data_parallel_size",
    "prompt_bytes",
    "rank_headers",
    "request_pinning",
    "shard",
]

DP_RANK_HEADER = "X-data-parallel-rank"
"""The header vLLM's OpenAI server reads a request's DP rank from
(``OpenAIServing._get_data_parallel_rank``; case-insensitive)."""

_MASK64 = (1 << 64) - 1


def _check_size(data_parallel_size: Any) -> int:
    if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int):
        raise TypeError(f"data_parallel_size must be an int, got {data_parallel_size!r}")
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    return data_parallel_size


def _token_bytes(ids: Iterable[Any]) -> bytes:
    ids = list(ids)
    for t in ids:
        # numpy integers have __index__; floats and bools are not token ids
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise TypeError(f"token ids must be ints, got {t!r}")
    return b"i" + struct.pack(f"<{len(ids)}q", *(int(t) for t in ids))


def prompt_bytes(prompt: Any) -> bytes:
    """The canonical bytes a prompt is hashed from.

    A ``str`` (its UTF-8), a sequence of token ids (little-endian int64, as
    the drafter keys its sibling groups), ``bytes``, a vLLM prompt dict
    (``prompt_token_ids`` if present, else ``prompt``), or a chat message
    list (canonical JSON). Text and token ids of the same prompt hash
    differently: hash the same form everywhere you route.
    """
    if isinstance(prompt, str):
        return b"s" + prompt.encode("utf-8")
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        return b"b" + bytes(prompt)
    if isinstance(prompt, dict):
        if prompt.get("prompt_token_ids") is not None:
            return _token_bytes(prompt["prompt_token_ids"])
        if isinstance(prompt.get("prompt"), str):
            return prompt_bytes(prompt["prompt"])
        raise TypeError("a prompt dict needs 'prompt_token_ids' or a 'prompt' string, "
                        f"got keys {sorted(prompt)}")
    if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple)):  # numpy array
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)):
        if prompt and all(isinstance(m, dict) for m in prompt):  # chat messages
            text = json.dumps(list(prompt), sort_keys=True, ensure_ascii=False,
                              separators=(",", ":"))
            return b"m" + text.encode("utf-8")
        return _token_bytes(prompt)
    raise TypeError("prompt must be text, token ids, bytes, a prompt dict or chat messages, "
                    f"got {type(prompt).__name__}")


def _jump_hash(key: int, buckets: int) -> int:
    """Lamping & Veach's jump consistent hash: a bucket in [0, buckets).
    ``j`` grows every round, so the loop runs at most ``buckets`` times."""
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & _MASK64
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


def data_parallel_rank(prompt: Any, data_parallel_size: int) -> int:
    """The DP rank in ``[0, data_parallel_size)`` for every request of ``prompt``.

    Deterministic across processes and runs; siblings of a prompt (and
    resubmissions of it) all get the same rank, and distinct prompts spread
    evenly over the ranks.
    """
    size = _check_size(data_parallel_size)
    if size == 1:
        prompt_bytes(prompt)  # still reject what is not a prompt
        return 0
    key = int.from_bytes(hashlib.blake2b(prompt_bytes(prompt), digest_size=8).digest(), "little")
    return _jump_hash(key, size)


def rank_headers(prompt: Any, data_parallel_size: int) -> dict[str, str]:
    """HTTP headers pinning a request for ``prompt`` to its DP rank, for the
    ``openai`` client's ``extra_headers=`` (empty when there is one engine).

    ``data_parallel_size`` is the server's ``--data-parallel-size`` (with
    ``--data-parallel-external-lb`` route by :func:`data_parallel_rank` in
    the router instead: each server then fronts one rank)."""
    size = _check_size(data_parallel_size)
    if size == 1:
        prompt_bytes(prompt)
        return {}
    return {DP_RANK_HEADER: str(data_parallel_rank(prompt, size))}


def shard(items: Sequence[Any], rank: int, data_parallel_size: int,
          key: Callable[[Any], Any] | None = None) -> list[int]:
    """Indices of the ``items`` (problems or prompts) that DP rank ``rank``
    should run, for offline DP with one ``LLM`` per rank: each process runs
    ``self_consistency`` on its shard, so all of a problem's paths share one
    engine. ``key(item)`` gives the prompt to hash (default: the item)."""
    size = _check_size(data_parallel_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"rank must be an int in [0, {size}), got {rank!r}")
    key = key or (lambda item: item)
    return [i for i, item in enumerate(items) if data_parallel_rank(key(item), size) == rank]


def engine_data_parallel_size(engine: Any) -> int:
    """``data_parallel_size`` of a vLLM engine, ``LLM`` or ``VllmConfig``
    (1 when it cannot be read, e.g. a stand-in engine)."""
    for obj in (engine, getattr(engine, "llm_engine", None)):
        if obj is None:
            continue
        config = obj if hasattr(obj, "parallel_config") else getattr(obj, "vllm_config", None)
        size = getattr(getattr(config, "parallel_config", None), "data_parallel_size", None)
        if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
            return size
    return 1


def _takes_rank(add_request: Any) -> bool:
    try:
        params = inspect.signature(add_request).parameters
    except (TypeError, ValueError):
        return False
    return "data_parallel_rank" in params


def request_pinning(engine: Any) -> Callable[[Any], dict[str, int]]:
    """``prompt -> add_request keyword arguments`` pinning the prompt to its
    DP rank on ``engine``.

    Gives ``{"data_parallel_rank": r}`` when the engine runs DP > 1 *and* its
    ``add_request`` takes that argument (``AsyncLLM`` does), else ``{}``.
    vLLM 0.32's ``LLMEngine`` takes none: it fronts a single engine core
    (``LLM(data_parallel_size>1)`` is refused; with the external launcher each
    process is one rank, and gets ``{}`` here), so there the paths of a
    problem, all added to the one engine, are together already.
    """
    size = engine_data_parallel_size(engine)
    config = getattr(engine, "vllm_config", None)
    backend = getattr(getattr(config, "parallel_config", None), "distributed_executor_backend", None)
    if size == 1 or backend == "external_launcher" \
            or not _takes_rank(getattr(engine, "add_request", None)):
        return lambda prompt: {}
    return lambda prompt: {"data_parallel_rank": data_parallel_rank(prompt, size)}
