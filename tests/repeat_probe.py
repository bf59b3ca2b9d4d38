"""Memory probe: the same requests sent again and again (a health check, a
cached eval), through :class:`consensus_spec.ConsensusProposer` driven the
way vLLM's model runner drives it.

Each request samples ``n`` paths greedily, so all its paths are identical:
they run in lockstep and finish together with the same (length, hash). A
fixed batch of ``rows`` rows is refilled from a queue as paths finish; a
finished row gets one last propose call and then leaves, the batch
condensed the way vLLM condenses it (the last row moves into each hole).
Drafts are verified against the path's fixed answer (greedy: a draft token
is accepted iff it is the next token).

``tracemalloc``'s traced memory is read after warm-up and at each third of
the requests; a leak shows as growth that does not die out (the last third
growing as much as the first, or more). Run it by hand with
``python -m tests.repeat_probe``; ``tests/test_rows.py`` runs a short one.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections import deque
from types import SimpleNamespace

import numpy as np

from consensus_spec import ConsensusProposer


def stand_in_config(k: int, max_model_len: int, max_num_seqs: int) -> SimpleNamespace:
    """The parts of vLLM's ``VllmConfig`` the proposer reads."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
    )


def fixed_prompt_requests(prompt_len: int = 32, answer_len: int = 40):
    """``i -> (prompt, answer)``: one prompt, one answer, every time."""
    prompt = [100 + t for t in range(prompt_len)]
    answer = [1000 + (7 * t) % 97 for t in range(answer_len)]
    return lambda i: (prompt, answer)


def short_answer_requests(num_prompts: int = 64, prompt_len: int = 24, answer_len: int = 3):
    """``i -> (prompt, answer)``: ``num_prompts`` different prompts in turn,
    each with its own short answer (as in math: "#### 42")."""
    prompts = [[200 + p, 300 + p] + [100 + t for t in range(prompt_len - 2)]
               for p in range(num_prompts)]
    answers = [[900, 5000 + p, 901][:answer_len] + [902] * max(answer_len - 3, 0)
               for p in range(num_prompts)]
    return lambda i: (prompts[i % num_prompts], answers[i % num_prompts])


def counters(proposer) -> dict:
    """What bounds the proposer's memory, now."""
    rows, drafter = proposer.rows, proposer.drafter
    return {
        "num_parked": rows.num_parked, "parked_keys": rows.num_parked_keys,
        "paths_released": rows.paths_released, "live_paths": drafter.num_paths,
        "path_slots": drafter.path_slots, "live_groups": drafter.num_live_groups,
        "groups": drafter.num_groups, "tries": drafter.num_tries,
        "arena_bytes": drafter.arena_bytes, "trie_nodes": drafter.num_nodes(),
        "evictions": drafter.evictions, "paths_started": rows.paths_started,
    }


def run(requests: int = 2400, rows: int = 64, n: int = 8, k: int = 5, make=None,
        trace: bool = True, warmup_requests: int = 64, on_request=None, **options) -> dict:
    """Send ``requests`` requests of ``n`` identical paths each (``make(i)``
    gives request i's prompt and answer, default :func:`fixed_prompt_requests`)
    through a proposer over a ``rows``-row batch. Returns the traced memory
    (bytes) after ``warmup_requests`` and at each third, its growth per third,
    the counters at the end and their peaks, and the acceptance.
    ``on_request(proposer, finished)``, if given, is called as each request
    finishes. ``options`` go to the proposer (default cost model: off)."""
    make = make or fixed_prompt_requests()
    options.setdefault("cost_model", "off")
    longest = max(len(p) + len(a) for p, a in map(make, range(min(requests, 1000))))
    width = longest + k + 2
    proposer = ConsensusProposer(stand_in_config(k, width + 8, rows), **options)
    buf = np.zeros((rows, width), np.int32)
    num = np.zeros(rows, np.int32)
    queue: deque = deque()  # (request, prompt, answer) per path not yet admitted
    live: list = []         # per row: [request, sequence, tokens so far, done]
    sampled: list = []
    left = {}               # request -> its paths not finished
    finished = admitted = 0
    marks = sorted({0, requests // 3, 2 * requests // 3, requests})
    traced: dict = {}
    peaks: dict = {}
    drafted = accepted = 0

    def mark(at: int) -> None:
        if trace and at in marks and at not in traced:
            gc.collect()
            traced[at] = tracemalloc.get_traced_memory()[0]

    if trace:
        tracemalloc.start()
    mark(-warmup_requests)  # the start, when there is no warm-up
    try:
        while finished < requests + warmup_requests:
            while len(live) < rows and (queue or admitted < requests + warmup_requests):
                if not queue:
                    prompt, answer = make(admitted)
                    queue.extend((admitted, prompt, answer) for _ in range(n))
                    left[admitted] = n
                    admitted += 1
                req, prompt, answer = queue.popleft()
                seq = prompt + answer
                i = len(live)
                live.append([req, seq, len(prompt) + 1, False])  # prefill sampled one token
                buf[i, :len(prompt) + 1] = seq[:len(prompt) + 1]
                num[i] = len(prompt) + 1
                sampled.append([seq[len(prompt)]])
            drafts = proposer.propose(sampled, num, buf)
            if any(r[3] for r in live):  # finished rows had their last call: condense
                keep = [j for j, r in enumerate(live) if not r[3]]
                for dst, src in enumerate(keep):
                    if src != dst:
                        buf[dst, :live[src][2]] = buf[src, :live[src][2]]
                        num[dst] = live[src][2]
                live = [live[j] for j in keep]
                sampled = [sampled[j] for j in keep]
                drafts = [drafts[j] for j in keep]
                num[len(live):] = 0
            for i, row in enumerate(live):
                _, seq, at, _ = row
                draft = list(drafts[i])[:k]
                acc = 0
                while acc < len(draft) and at + acc < len(seq) and draft[acc] == seq[at + acc]:
                    acc += 1
                new = seq[at:at + acc + 1]
                buf[i, at:at + len(new)] = new
                row[2] = num[i] = at + len(new)
                sampled[i] = new
                drafted += len(draft)
                accepted += acc
                if row[2] >= len(seq):
                    row[3] = True
                    left[row[0]] -= 1
                    if not left[row[0]]:
                        del left[row[0]]
                        finished += 1
                        mark(finished - warmup_requests)
                        for key, value in counters(proposer).items():
                            peaks[key] = max(peaks.get(key, value), value)
                        if on_request is not None:
                            on_request(proposer, finished)
        mark(requests)
    finally:
        if trace:
            tracemalloc.stop()
    out = {"requests": requests, "rows": rows, "n": n, "counters": counters(proposer),
           "peaks": peaks, "acceptance": accepted / max(drafted, 1)}
    if trace:
        points = [traced[m] for m in marks]
        out["traced"] = dict(zip(marks, points))
        out["growth"] = [b - a for a, b in zip(points, points[1:])]
    return out


def main() -> None:
    for name, make in (("one prompt, 40-token answers", fixed_prompt_requests()),
                       ("64 prompts, 3-token answers", short_answer_requests())):
        out = run(make=make)
        first, *_, last = out["growth"]
        print(f"{name}: growth first third {first / 1024:.0f} kB, last third "
              f"{last / 1024:.0f} kB; at the end {out['counters']}; peaks {out['peaks']}")


if __name__ == "__main__":
    main()
