"""Self-consistency (sample N reasoning paths, vote on the answer) on vLLM.

We drive ``llm.llm_engine`` step by step instead of calling ``llm.generate``
so that a problem's paths can be submitted in waves (scouts first) and
aborted early once its vote is settled.  The scheduling rules and the
engine step loop live in :mod:`consensus_spec.scheduling`; result types in
:mod:`consensus_spec.results`.  Their names are importable from here too.

Speculative-decoding statistics come from vLLM's own Prometheus counters
(``llm.get_metrics()``), read before and after the run.  ``vllm.LLM`` turns
stat logging off by default: build it with ``disable_log_stats=False`` or the
stats are reported as None.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from .answers import DEFAULT_TIMEOUT_S, extract_answer
from .results import ProblemResult, Sample, SelfConsistencyRun, SpecDecodeStats  # noqa: F401
from .scheduling import (  # noqa: F401  (_stop_rule, _tokens_saved: re-exported)
    PathPlanner,
    _stop_rule,
    _tokens_saved,
    read_spec_counters,
    run_paths,
    should_stop,
    spec_stats_delta,
)

__all__ = [
    "PathPlanner",
    "ProblemResult",
    "Sample",
    "SelfConsistencyRun",
    "SpecDecodeStats",
    "read_spec_counters",
    "run_paths",
    "self_consistency",
    "should_stop",
]


def _render_prompt(problem: Any, prompt_template) -> Any:
    if prompt_template is None:
        return problem
    if callable(prompt_template):
        return prompt_template(problem)
    # str.replace, not format(): templates are full of LaTeX braces
    return prompt_template.replace("{problem}", str(problem))


def self_consistency(
    llm,
    problems: Sequence[Any],
    n: int = 16,
    temperature: float = 0.8,
    top_p: float = 1.0,
    max_tokens: int = 1024,
    seed: int | None = None,
    prompt_template: str | Callable[[Any], Any] | None = None,
    scouts: int = 0,
    early_stop: bool | float | str | None = None,
    weighted: bool = False,
    weight_method: str = "exp_mean",
    stop: list[str] | None = None,
    logprobs: bool = True,
    capacity: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    extract: Callable[[str], str | None] = extract_answer,
    sampling_kwargs: dict[str, Any] | None = None,
    on_problem_done: Callable[[int], None] | None = None,
) -> SelfConsistencyRun:
    """Sample ``n`` paths per problem with ``llm`` (a ``vllm.LLM``) and vote.

    ``prompt_template``: None (problems are prompts), a string with a
    ``{problem}`` placeholder, or a callable problem -> prompt.
    ``scouts``: submit this many paths per problem first and the rest once
    they finish (pipelined across problems; see :class:`PathPlanner`).
    ``early_stop``: True/"decided" aborts a problem's remaining paths once its
    leader cannot be overtaken; a number also stops when the leader is ahead
    by that many votes.  ``weighted``: weight votes by
    :func:`voting.logprob_weights` of mean token logprobs (``weight_method``).
    ``logprobs``: request the sampled tokens' logprobs (needed for weights and
    best-of-n).  ``seed`` makes path k of problem i use seed
    ``seed + i * n + k``, so results do not depend on scheduling.
    ``capacity``: paths in flight before new problems wait (default: the
    engine's ``max_num_seqs``).  The engine must be idle: outputs of other
    requests would be swallowed.  ``on_problem_done(index)`` is called once
    per problem when its vote is complete (all paths done or stopped early),
    e.g. to advance a progress bar.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if weighted and not logprobs:
        raise ValueError("weighted voting needs logprobs=True")
    engine = llm.llm_engine
    if capacity is None:
        sched = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
        capacity = getattr(sched, "max_num_seqs", None)
    # DELTA outputs let us count the tokens of paths we abort.
    delta = early_stop not in (None, False)
    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY

    def make_params(p: int, k: int):
        return SamplingParams(
            n=1,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            seed=None if seed is None else seed + p * n + k,
            logprobs=0 if logprobs else None,
            stop=stop,
            output_kind=kind,
            **(sampling_kwargs or {}),
        )

    render = getattr(llm, "_preprocess_cmpl_one", None)  # what LLM.generate uses
    prompts = [_render_prompt(p, prompt_template) for p in problems]
    before = read_spec_counters(llm)
    t0 = time.perf_counter()
    results = run_paths(
        engine, prompts, make_params, n=n, scouts=scouts, capacity=capacity,
        early_stop=early_stop, weighted=weighted, weight_method=weight_method,
        max_tokens=max_tokens, timeout_s=timeout_s, extract=extract, delta=delta,
        render=render, on_problem_done=on_problem_done,
    )
    wall = time.perf_counter() - t0
    stats = spec_stats_delta(before, read_spec_counters(llm))
    config = dict(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed,
                  scouts=scouts, early_stop=early_stop, weighted=weighted,
                  weight_method=weight_method, capacity=capacity)
    return SelfConsistencyRun(results, stats, wall, config)
