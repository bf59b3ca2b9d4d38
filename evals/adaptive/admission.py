"""How paths enter the waves replay (``python -m evals waves``): as the
engine's :class:`~consensus_spec.sampling.waves.PathPlanner` releases them
(:class:`WaveAdmission`) and, with ``--forecast``, with votes on running
paths too (:class:`InFlightAdmission`, the experiment of
:mod:`evals.adaptive.forecast_model`): the models each set gets, and the
oracle ceiling (``--forecast-model oracle:AT``)."""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass

from consensus_spec.voting.answers import answers_equal

from ..replay.engine import Queued
from ..traces import shared_path
from .forecast import DEFAULT_TRACES as FIT_SETS
from .forecast import fit_others, load_paths
from .forecast_model import PROGRESS_BANDS, ForecastModel, InFlightCheck, flip_with_running, vote_running


class WaveAdmission(Queued):
    """Paths enter the replay as a PathPlanner releases them."""

    def __init__(self, planner, class_ids: list[list[int | None]]):
        super().__init__(planner.admit())
        self.planner, self.class_ids = planner, class_ids

    def finished(self, p: int, path: int) -> list[tuple[int, int]]:
        """Paths to abort that are running (those still queued are dropped)."""
        submit, abort = self.planner.on_finish(p, path, self.class_ids[p][path])
        self.queue.extend(submit)
        return self._running(abort)

    def _running(self, abort: list[tuple[int, int]]) -> list[tuple[int, int]]:
        if not abort:
            return []
        queued = set(self.queue) & set(abort)
        if queued:
            self.queue = deque(x for x in self.queue if x not in queued)
        return [x for x in abort if x not in queued]


class InFlightAdmission(WaveAdmission):
    """A :class:`WaveAdmission` whose problems, every
    ``stride`` steps, also take the vote that counts their running paths
    (:func:`~evals.adaptive.forecast_model.vote_running` with ``in_flight``, an
    :class:`~evals.adaptive.forecast_model.InFlightCheck`): ``answers``
    and ``lengths`` per problem and path, ``texts(p, path, tokens)`` what
    the check reads of a running path."""

    def __init__(self, planner, class_ids, in_flight, answers, lengths, texts, stride: int = 8):
        super().__init__(planner, class_ids)
        self.in_flight, self.answers, self.lengths, self.texts = in_flight, answers, lengths, texts
        self.stride, self.steps = stride, 0

    def progress(self, running: dict[tuple[int, int], int]) -> list[tuple[int, int]]:
        self.steps += 1
        if self.steps % self.stride:
            return []
        by_problem: dict[int, dict[int, int]] = {}
        for (p, k), tokens in running.items():
            by_problem.setdefault(p, {})[k] = tokens
        aborts = []
        for p, paths in by_problem.items():
            def check(done, _answers, run, unstarted, p=p, paths=paths):
                return self.in_flight([self.answers[p][k] for k in done],
                                      [self.lengths[p][k] for k in done],
                                      [(paths.get(k, 0), lambda k=k: self.texts(p, k, paths.get(k, 0)))
                                       for k in run], unstarted)
            submit, abort = vote_running(self.planner, p, check)
            self.queue.extend(submit)
            aborts += self._running(abort)
        return aborts


def in_flight_admission(planner, rule, problems, ids, recorded, votes, texts, model, stride: int):
    """An :class:`InFlightAdmission` voting on running paths' forecasts
    (``model``), cut from the trace file's ``texts``; with ``model`` an
    :class:`OracleAt`, on their own final answers."""
    answers = [[votes[p].answers[i] for i in recorded[p]] for p in range(len(problems))]
    lengths = [[len(c) for c in prob.completions] for prob in problems]
    if isinstance(model, OracleAt):
        check = oracle_check(rule, model.at)
        cut = lambda p, k, tokens: (answers[p][k], lengths[p][k])  # noqa: E731
    else:
        check = InFlightCheck(rule, model=model, extract=texts.extract)
        cut = lambda p, k, tokens: texts.cut(votes[p].id, recorded[p][k], tokens)  # noqa: E731
    return InFlightAdmission(planner, ids, check, answers, lengths, cut, stride), check


@dataclass(frozen=True)
class OracleAt:
    """``--forecast-model oracle:AT``: a ceiling, not a forecast."""
    at: float


def oracle_check(rule, at: float):
    """The in-flight vote with each running path's own final answer known
    once it is ``at`` of its length through (before: the vote's own chance)."""
    class Oracle(InFlightCheck):  # no guard, no text: the ceiling of any forecast
        def __call__(self, answers, lengths, running, unstarted):
            if not running or all(a is None for a in answers):
                return False
            self.checks += 1
            lead, second, other, leader = self.shape(answers)
            length = sum(lengths) / len(lengths)
            base = self.prior.leader_share(lead, second, other, length)
            chances = []
            for tokens, final in running:
                answer, total = final()
                known = tokens >= at * total
                chances.append(base if not known else float(answer is not None and answers_equal(answer, leader)))
            return flip_with_running(self.prior, lead, second, other, chances, unstarted, length) <= self.rule.error

    return Oracle(rule)


def forecast_models(args, tokenizer, replayed: list[str]):
    """Set name -> forecast model (``--forecast-model``); ``others``: a
    shared set's model is fitted on the other shared sets, never on itself."""
    if args.forecast_model.startswith("oracle:"):
        oracle = OracleAt(float(args.forecast_model.split(":", 1)[1]))
        return lambda name: oracle
    if args.forecast_model not in ("others", "saved"):
        with open(args.forecast_model) as f:
            model = ForecastModel.from_json(json.load(f))
        return lambda name: model
    names = {os.path.splitext(t)[0]: t for t in FIT_SETS}
    if args.forecast_model == "saved" or not any(n in names for n in replayed):
        return lambda name: ForecastModel.default()
    sets = {n: load_paths(shared_path("traces", t), tokenizer, None, PROGRESS_BANDS) for n, t in names.items()}
    models = {name: fit_others(sets, name) for name in sets}
    return lambda name: models.get(name) or ForecastModel.default()


