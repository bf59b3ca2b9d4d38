"""The engine loop of self-consistency: run every problem's paths through an
engine in waves, vote, stop problems early.

:func:`run_paths` drives any engine with vLLM's ``LLMEngine`` request API
(``add_request``/``step``/``abort_request``) through a
:class:`~consensus_spec.sampling.path_book.PathBook` (the run's planner,
votes and stops), taking votes with
:class:`~consensus_spec.sampling.options.Voting` options and stopping with a
:class:`~consensus_spec.sampling.stopping.StopRule` (the options are resolved
and checked in :mod:`~consensus_spec.sampling.options`).  The
spec-decode counter helpers read vLLM's Prometheus metrics.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Sequence

from .options import LoopOptions
from .path_book import PathBook
from .results import SelfConsistencyRun, SpecDecodeStats
from .routing import request_pinning

__all__ = ["read_spec_counters", "run_paths", "spec_stats_delta"]

_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


def read_spec_counters(llm) -> dict[str, int] | None:
    """Current spec-decode counter totals, or None if vLLM does not expose them
    (stat logging disabled, or no speculative decoding configured)."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # AssertionError("Stat logging disabled") and API drift
        return None
    totals: dict[str, int] = {}
    for m in metrics:
        key = _SPEC_COUNTERS.get(getattr(m, "name", None))
        if key is not None and hasattr(m, "value"):  # sum across engines/labels
            totals[key] = totals.get(key, 0) + int(m.value)
    return totals if len(totals) == len(_SPEC_COUNTERS) else None


def spec_stats_delta(before: dict[str, int] | None, after: dict[str, int] | None) -> SpecDecodeStats | None:
    if before is None or after is None:
        return None
    return SpecDecodeStats(**{k: after[k] - before.get(k, 0) for k in after})


def run_paths(
    engine,
    prompts: Sequence[Any],
    make_params: Callable[[int, int], Any],
    n: int,
    options: LoopOptions | None = None,
    *,
    render: Callable[[Any], Any] | None = None,
    on_problem_done: Callable[[int], None] | None = None,
    **option_fields: Any,
) -> SelfConsistencyRun:
    """Engine-level loop behind :func:`self_consistency` (vLLM-agnostic).

    ``engine`` needs ``add_request(id, prompt, params, arrival_time=)``,
    ``step()``, ``abort_request(ids)`` and ``has_unfinished_requests()``, as
    ``vllm.LLM().llm_engine`` has.  ``make_params(problem, path)`` builds the
    sampling params.  ``options``: the run's
    :class:`~consensus_spec.sampling.options.LoopOptions` (schedule, stop
    rule, voting, max_tokens, delta, prior), or its fields as keywords
    (``stop_rule=...``), over it.  ``on_problem_done(problem)`` is called
    once per problem as soon as its vote is final.  Returns the run without
    spec-decode stats (the caller reads those from vLLM).
    """
    opts = LoopOptions.of(options, option_fields, "run_paths")
    delta = opts.delta
    if engine.has_unfinished_requests():
        raise RuntimeError("self_consistency needs an idle engine")
    book = PathBook(len(prompts), n, opts.schedule, opts.stop_rule, opts.voting, opts.max_tokens,
                    prior=opts.prior)
    planner = book.planner
    run_id = uuid.uuid4().hex[:8]
    rid = lambda p, k: f"sc{run_id}-{p}-{k}"  # noqa: E731
    ids: dict[str, tuple[int, int]] = {}
    steps = inflight_sum = 0
    pin = request_pinning(engine)  # a DP rank per prompt where the engine takes one

    def submit(paths: list[tuple[int, int]]) -> None:
        for p, k in paths:
            ids[rid(p, k)] = (p, k)
            prompt = render(prompts[p]) if render is not None else prompts[p]
            engine.add_request(rid(p, k), prompt, make_params(p, k), arrival_time=time.time(),
                               **pin(prompts[p]))

    t0 = time.perf_counter()
    try:
        submit(book.admit())
        while engine.has_unfinished_requests():
            steps += 1
            inflight_sum += planner.num_inflight
            finished = []
            for out in engine.step():  # count every token before aborting any
                key = ids.get(out.request_id)
                if key is not None and book.update(key, out.outputs[0], delta) and out.finished:
                    finished.append(key)
            for key in finished:
                if key not in book.accs:
                    continue  # aborted by an earlier finish in this step
                to_submit, to_abort = book.finish(key)
                if to_abort:
                    engine.abort_request([rid(p, k) for p, k in to_abort])
                submit(to_submit)
                if on_problem_done is not None and book.done(key[0]):
                    on_problem_done(key[0])
            if not engine.has_unfinished_requests():
                submit(book.admit())
    except BaseException:
        if book.accs:  # leave the engine idle for the caller
            engine.abort_request([rid(p, k) for p, k in book.accs])
        raise
    return book.run(time.perf_counter() - t0, steps, inflight_sum)
