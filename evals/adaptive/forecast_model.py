"""What a running path will answer, from its partial text: the replay
experiment behind ``python -m evals forecast`` and ``python -m evals waves
--forecast`` (pure logic, no vLLM).  It was ``StopRule(forecast=True)`` in
the library until it measured no gain (docs/stopping.md, "Voting on the
paths still running").

A path states its answer late, and one still running well past its
finished siblings is more often in the minority.  So a running path's
evidence is its progress (tokens so far over the median length of the
problem's finished paths) and whether the last answer in its partial text
is the leader's, another's or none.  :class:`ForecastModel` turns it into a
likelihood ratio per progress band, fitted on recorded traces (``python -m
evals forecast --write evals/adaptive/forecast.json``), that moves the
vote's own chance that a path ends on the leader
(:meth:`AnswerPrior.leader_share`).  :func:`flip_with_running` is the
``bayes`` rule's flip probability with running paths: a mixture over how
they end, each a vote for the leader with its forecast and otherwise,
conservatively, for the runner-up.  :class:`InFlightCheck` is that vote;
:func:`vote_running` takes it on a
:class:`~consensus_spec.sampling.waves.PathPlanner`'s problem.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable, Sequence

import numpy as np

from consensus_spec.sampling.answer_prior import AnswerPrior
from consensus_spec.sampling.stopping import StopRule, tally
from consensus_spec.voting.answers import DEFAULT_TIMEOUT_S, answers_equal, extract_answer
from consensus_spec.voting.vote import cluster_answers

__all__ = ["PROGRESS_BANDS", "STATES", "ForecastModel", "InFlightCheck", "evidence",
           "flip_with_running", "leader_votes", "vote_running"]

MODEL_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forecast.json")

# progress (tokens so far / median finished length): band i is [edge i-1, edge i)
PROGRESS_BANDS = (0.5, 0.7, 0.8, 0.9, 1.0, 1.1, 1.3, 1.6)
STATES = ("leader", "other", "none")  # the partial text's last answer: the leader's, another, none
MAX_LOG_RATIO = 4.0  # a forecast is never surer than e^4 : 1 on one path's text
SMOOTHING = 0.5  # pseudo-count per (band, state) cell when fitting
CLUSTER_MEMO = 1024  # finished-answer tuples an InFlightCheck remembers the vote of


def evidence(partial_text: str, leader: str | None, extract: Callable[[str], str | None],
             same: Callable[[str, str], bool]) -> str:
    """One of :data:`STATES`: whether the last answer ``extract`` finds in
    ``partial_text`` is the ``leader``'s (``same`` compares answers)."""
    found = extract(partial_text) if partial_text else None
    if found is None:
        return "none"
    return "leader" if leader is not None and same(found, leader) else "other"


@dataclass(frozen=True)
class ForecastModel:
    """Log likelihood ratios per (progress band, state): band i holds
    progress in [``bands[i-1]``, ``bands[i]``) (band 0 below the first edge,
    the last band above the last); each row gives one ratio per
    :data:`STATES`.  ``fitted_on``: what the ratios came from."""

    log_ratio: tuple[tuple[float, ...], ...]
    bands: tuple[float, ...] = PROGRESS_BANDS
    fitted_on: str = ""

    def __post_init__(self) -> None:
        rows = tuple(tuple(float(x) for x in row) for row in self.log_ratio)
        if len(rows) != len(self.bands) + 1 or any(len(r) != len(STATES) for r in rows) \
                or not all(math.isfinite(x) for r in rows for x in r):
            raise ValueError(f"ForecastModel.log_ratio needs {len(self.bands) + 1} rows of "
                             f"{len(STATES)} finite numbers")
        if list(self.bands) != sorted(set(self.bands)) or not self.bands or self.bands[0] <= 0:
            raise ValueError("ForecastModel.bands must be increasing numbers > 0")
        object.__setattr__(self, "log_ratio", rows)
        object.__setattr__(self, "bands", tuple(float(b) for b in self.bands))

    def band(self, progress: float) -> int:
        return int(np.searchsorted(self.bands, progress, side="right"))

    def p_leader(self, base: float, progress: float | None, state: str) -> float:
        """P(the path ends on the leader) given the vote's own chance
        ``base`` and the path's evidence; ``progress`` None (no finished
        sibling to measure it by): ``base``."""
        if progress is None:
            return base
        base = min(max(base, 1e-9), 1.0 - 1e-9)
        logit = math.log(base / (1.0 - base)) + self.log_ratio[self.band(progress)][STATES.index(state)]
        return 1.0 / (1.0 + math.exp(-logit))

    @classmethod
    def fit(cls, paths: Iterable[tuple[bool, Sequence[tuple[float, str]]]], *, bands=PROGRESS_BANDS,
            fitted_on: str = "") -> "ForecastModel":
        """From recorded paths: per path, (whether it ended on the leader,
        its (progress, state) checks while it ran, at most one per band).
        Checks below the first edge are ignored (band 0 carries no evidence).
        Per band and state: log P(checked there in that state | leader) /
        P(same | not leader), smoothed and clipped at :data:`MAX_LOG_RATIO`.
        How many paths reach a band is part of its evidence: a path still
        running long after its siblings finished is more often a minority one."""
        probe = cls(((0.0,) * len(STATES),) * (len(bands) + 1), tuple(bands))
        counts = np.zeros((2, len(bands) + 1, len(STATES)))
        totals = np.zeros(2)
        for on_leader, checks in paths:
            totals[int(bool(on_leader))] += 1
            for progress, state in checks:
                counts[int(bool(on_leader)), probe.band(progress), STATES.index(state)] += 1
        if totals.min() == 0:
            raise ValueError("ForecastModel.fit needs paths that end on the leader and paths that do not")
        rate = (counts + SMOOTHING) / (totals[:, None, None] + 2 * SMOOTHING)
        ratio = np.clip(np.log(rate[1] / rate[0]), -MAX_LOG_RATIO, MAX_LOG_RATIO)
        ratio[0] = 0.0  # below the first edge a path is not read: no evidence
        return cls(tuple(tuple(round(float(x), 4) for x in row) for row in ratio), tuple(bands),
                   fitted_on)

    def to_json(self) -> dict:
        return {"bands": list(self.bands), "states": list(STATES),
                "log_ratio": [list(r) for r in self.log_ratio], "fitted_on": self.fitted_on}

    @classmethod
    def from_json(cls, obj: dict) -> "ForecastModel":
        if not isinstance(obj, dict) or obj.get("states") != list(STATES):
            raise ValueError(f"a ForecastModel JSON has bands, states {list(STATES)} and log_ratio")
        return cls(tuple(map(tuple, obj["log_ratio"])), tuple(obj["bands"]), obj.get("fitted_on", ""))

    @classmethod
    def default(cls) -> "ForecastModel":
        """The fitted model (``evals/adaptive/forecast.json``, fitted on the shared traces)."""
        return _default()


def leader_votes(running: Sequence[float]) -> np.ndarray:
    """P(a of the running paths end on the leader), a = 0..len(running),
    each ending there independently with its chance in ``running``."""
    dist = np.ones(1)
    for q in running:
        q = min(max(float(q), 0.0), 1.0)
        dist = np.concatenate([dist * (1.0 - q), [0.0]]) + np.concatenate([[0.0], dist * q])
    return dist


def flip_with_running(prior: AnswerPrior, lead: int, second: int, other: int,
                      running: Sequence[float], unstarted: int, length: float | None = None) -> float:
    """P(the vote flips) when ``running`` paths are still running, each
    ending on the leader with the given chance, and ``unstarted`` have not
    started; ``lead``/``second``/``other`` count the finished paths as in
    :meth:`AnswerPrior.flip_probability`.  A running path that does not end
    on the leader is counted for the runner-up (the worst it can do), and a
    runner-up level with or ahead of the leader counts as a flip."""
    m = len(running)
    flip = 0.0
    for a, mass in enumerate(leader_votes(running)):
        if mass <= 0.0:
            continue
        lead_a, second_a = lead + a, second + m - a
        if second_a >= lead_a:
            flip += mass
        else:
            flip += mass * prior.flip_probability(lead_a, second_a, other, unstarted, length)
    return min(1.0, flip)


class InFlightCheck:
    """The ``bayes`` stop vote counting the paths still running.

    Called with the started paths that finished (answers and lengths, in
    path order), the running ones as (tokens so far, a callable giving the
    partial text) and the paths not started: True once
    :func:`flip_with_running` is <= the rule's error.  The partial text is
    read only when the vote could stop if every running path ended on the
    leader, and only for paths past the model's first progress band.  No
    vote is taken while more paths run than have finished: with most paths
    running at once (all n at once, an idle server's run-ahead) the finished
    ones are the shortest, a biased few, and forecasts of many running paths
    share their errors (replayed with all 40 addsub paths at once, votes
    without this guard agreed with the full vote on 90.9% of problems).
    ``extract`` finds the last answer in a partial text (default: the
    voting's extractor with its last-number fallback).
    """

    def __init__(self, rule: StopRule, prior: AnswerPrior | None = None,
                 model: ForecastModel | None = None,
                 extract: Callable[[str], str | None] = extract_answer,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if rule.kind != "bayes":
            raise ValueError(f"forecasts feed the bayes rule, not {rule.kind!r}")
        self.rule, self.prior = rule, prior or AnswerPrior.default()
        self.model = model or ForecastModel.default()
        self.extract, self.timeout_s = extract, timeout_s
        self.checks = self.reads = 0  # votes taken, partial texts read
        self._shapes: dict[tuple, tuple] = {}  # finished answers -> shape() (bounded)

    def shape(self, answers: Sequence[str | None]) -> tuple[int, int, int, str]:
        """(leader's votes, runner-up's, the rest, the leader's answer) of
        finished answers (at least one not None)."""
        key = tuple(answers)
        got = self._shapes.get(key)
        if got is None:  # the same finished answers are voted on every few steps: cluster once
            if len(self._shapes) >= CLUSTER_MEMO:
                self._shapes.clear()
            ids = cluster_answers(list(answers), self.timeout_s)
            ranked = tally(ids)
            lead = ranked[0][1]
            second = ranked[1][1] if len(ranked) > 1 else 0
            leader = next(a for a, i in zip(answers, ids) if i == ranked[0][0])
            got = self._shapes[key] = (lead, second, len(ids) - lead - second, leader)
        return got

    def __call__(self, answers: Sequence[str | None], lengths: Sequence[int],
                 running: Sequence[tuple[int, Callable[[], str]]], unstarted: int) -> bool:
        if not running or all(a is None for a in answers) or len(running) > len(answers):
            return False  # more running than finished: see the class docstring
        lead, second, other, leader = self.shape(answers)
        length = sum(lengths) / len(lengths) if lengths else None
        error = self.rule.error
        self.checks += 1
        if flip_with_running(self.prior, lead, second, other, [1.0] * len(running), unstarted,
                             length) > error:
            return False  # not even if every running path ended on the leader
        base = self.prior.leader_share(lead, second, other, length)
        median = float(np.median(lengths)) if lengths else 0.0
        chances = []
        for tokens, text in running:
            progress = tokens / median if median > 0 else None
            if progress is None or progress < self.model.bands[0]:
                chances.append(base)
                continue
            self.reads += 1
            state = evidence(text(), leader, self.extract,
                             lambda a, b: answers_equal(a, b, self.timeout_s))
            chances.append(self.model.p_leader(base, progress, state))
        return flip_with_running(self.prior, lead, second, other, chances, unstarted, length) <= error


def vote_running(planner, p: int, check: Callable[[list, list, list, int], bool]) -> tuple[list, list]:
    """A vote on problem ``p`` of ``planner`` (a
    :class:`~consensus_spec.sampling.waves.PathPlanner`) that counts the
    paths still running: ``check(paths, answers, running, remaining)`` is
    asked with the started paths that finished and their answers (in path
    order), the running paths and the number not started
    (:meth:`PathPlanner.progress`); if it says stop, the problem stops as
    after a finished path's vote (:meth:`PathPlanner.stop`).  Returns
    (paths to submit, paths to abort)."""
    now = planner.progress(p)
    if now is None or planner.stop_check is None:
        return [], []
    if check(now.finished, now.answers, now.running, now.not_started):
        return planner.stop(p)
    return [], []


@lru_cache(maxsize=1)
def _default() -> ForecastModel:
    with open(MODEL_JSON) as f:
        return ForecastModel.from_json(json.load(f))
