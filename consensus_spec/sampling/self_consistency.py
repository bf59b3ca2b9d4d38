"""Self-consistency (sample N reasoning paths, vote on the answer) on vLLM.

We drive ``llm.llm_engine`` step by step instead of calling ``llm.generate``
so that a problem's paths can run in waves, with a vote after each wave that
may stop the problem early (adaptive self-consistency), while waves of other
problems keep the batch full.  Options come in three frozen configs:
:class:`~consensus_spec.sampling.waves.Schedule` (waves, capacity, when to check),
:class:`~consensus_spec.sampling.stopping.StopRule` (when a vote may stop) and
:class:`~consensus_spec.sampling.options.Voting` (answer extraction, weights), resolved
and checked in :mod:`consensus_spec.sampling.options`.  The pure planner is
:mod:`consensus_spec.sampling.waves`, the engine loop
:mod:`consensus_spec.sampling.engine_loop`, result types :mod:`consensus_spec.sampling.results`;
their names are importable from here too.

Speculative-decoding statistics come from vLLM's own Prometheus counters
(``llm.get_metrics()``), read before and after the run.  ``vllm.LLM`` turns
stat logging off by default: build it with ``disable_log_stats=False`` or the
stats are reported as None.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from .results import ProblemResult, Sample, SelfConsistencyRun, SpecDecodeStats  # noqa: F401
from .engine_loop import read_spec_counters, run_paths, spec_stats_delta
from .options import Voting, parse_stop_rule, parse_voting, resolve_schedule
from .answer_prior import AnswerPrior
from .stopping import StopRule
from .waves import ALL_AT_ONCE, PathPlanner, Schedule

__all__ = [
    "ALL_AT_ONCE",
    "AnswerPrior",
    "PathPlanner",
    "ProblemResult",
    "Sample",
    "Schedule",
    "SelfConsistencyRun",
    "SpecDecodeStats",
    "StopRule",
    "Voting",
    "read_spec_counters",
    "run_paths",
    "self_consistency",
]

_LEGACY_VOTING = ("weighted", "weight_method", "timeout_s", "extract")


def _render_prompt(problem: Any, prompt_template) -> Any:
    if prompt_template is None:
        return problem
    if callable(prompt_template):
        return prompt_template(problem)
    # str.replace, not format(): templates are full of LaTeX braces
    return prompt_template.replace("{problem}", str(problem))


_REMOVED = {"scouts": "schedule=Schedule(waves=(S, 'rest'))",
            "capacity": "schedule=Schedule(capacity=...)",
            **{k: f"voting=Voting({k}=...)" for k in _LEGACY_VOTING}}


def _removed_keywords(legacy: dict[str, Any]) -> None:
    """Keywords of 0.1's first API are gone: say what to write instead."""
    hints = [f"{k}= -> {_REMOVED[k]}" for k in sorted(legacy) if k in _REMOVED]
    unknown = sorted(set(legacy) - set(_REMOVED))
    if hints:
        raise TypeError("self_consistency() no longer takes " + "; ".join(hints))
    raise TypeError(f"self_consistency() got unexpected keyword argument(s): {', '.join(unknown)}")


def self_consistency(
    llm,
    problems: Sequence[Any],
    n: int = 16,
    temperature: float = 0.8,
    top_p: float = 1.0,
    max_tokens: int = 1024,
    seed: int | None = None,
    prompt_template: str | Callable[[Any], Any] | None = None,
    *,
    early_stop: bool | str | dict | StopRule | None = None,
    schedule: Schedule | None = None,
    voting: Voting | None = None,
    logprobs: bool | None = None,
    stop: list[str] | None = None,
    sampling_kwargs: dict[str, Any] | None = None,
    on_problem_done: Callable[[int], None] | None = None,
    prior: AnswerPrior | None = None,
    **legacy: Any,
) -> SelfConsistencyRun:
    """Sample up to ``n`` paths per problem with ``llm`` (a ``vllm.LLM``) and vote.

    ``prompt_template``: None (problems are prompts), a string with a
    ``{problem}`` placeholder, or a callable problem -> prompt.
    ``early_stop``: None (all ``n`` paths), True (the default
    :class:`StopRule`: stop once the chance that the rest of the paths flip
    the vote is <= 0.2% under a prior over how problems split their answers,
    which the run learns from its finished problems), ``"decided"`` (exact:
    only when the remaining paths cannot change the winner), another rule
    kind, text like ``"bayes:0.01"``, a dict of StopRule fields, or a
    :class:`StopRule` (:func:`~consensus_spec.sampling.options.parse_stop_rule`).  ``prior``: the :class:`AnswerPrior` the
    rule learns into (default: a new one per call; pass one to carry what it
    learned across calls that feed problems a few at a time).
    ``schedule``: :class:`Schedule` (waves, capacity, check); default: waves
    of 2 with a vote after every path in path order with a stop rule, all at
    once without; capacity defaults to the engine's ``max_num_seqs``.
    ``voting``: :class:`Voting` (answer extraction, logprob weights).
    ``logprobs``: request the sampled tokens' logprobs; None (default): only
    when weighted voting needs them (they cost vLLM extra work per draft
    token); pass True for best-of-n by mean logprob.  ``seed`` makes path k of problem i use seed
    ``seed + i * n + k``, so results do not depend on scheduling.
    ``stop`` and ``sampling_kwargs`` go to ``SamplingParams``.
    The engine must be idle: outputs of other requests would be swallowed.
    ``on_problem_done(index)`` is called once per problem when its vote is
    final, e.g. to advance a progress bar.

    The first API's keywords (``scouts``, ``capacity``, ``weighted``,
    ``weight_method``, ``timeout_s``, ``extract``) are errors that name the
    :class:`Schedule` / :class:`Voting` field to use instead.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if legacy:
        _removed_keywords(legacy)
    voting = parse_voting(voting)
    stop_rule = parse_stop_rule(early_stop)
    schedule = resolve_schedule(schedule, stop_rule)
    if logprobs is None:  # they cost vLLM extra work per draft token: only when used
        logprobs = voting.weighted
    if voting.weighted and not logprobs:
        raise ValueError("weighted voting needs logprobs=True")
    engine = llm.llm_engine
    if schedule.capacity is None:
        sched = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
        capacity = getattr(sched, "max_num_seqs", None)
        if isinstance(capacity, int) and capacity > 0:
            schedule = dataclasses.replace(schedule, capacity=capacity)
    # DELTA outputs let us count the tokens of paths we abort; runs that can
    # never abort (Schedule.may_abort) ask for the cheaper final outputs.
    delta = stop_rule is not None and schedule.may_abort
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
    run = run_paths(engine, prompts, make_params, n, schedule=schedule, stop_rule=stop_rule,
                    voting=voting, max_tokens=max_tokens, delta=delta, render=render,
                    on_problem_done=on_problem_done, prior=prior)
    run.spec_decode = spec_stats_delta(before, read_spec_counters(llm))
    run.config.update(temperature=temperature, top_p=top_p, seed=seed)
    return run

