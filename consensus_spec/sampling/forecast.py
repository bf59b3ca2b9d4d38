"""What a running path will answer, from its partial text (pure logic, no vLLM).

A stop vote that waits only for finished paths ignores the paths still
running, though their text already says something.  Measured on recorded
traces (docs/stopping.md): a path states its answer late, and the last
number in its partial text is its final answer mostly in the last tenth of
its length; a path still running well past its finished siblings' length
is more often in the minority.  So the evidence a running path gives is
(its progress: tokens so far over the median length of the problem's
finished paths, and whether the last answer in its partial text is the
leader's, another's, or none).

:class:`ForecastModel` turns that evidence into a likelihood ratio, "this
evidence from a path that ends on the leader" over "from one that does
not", per band of progress, fitted on recorded traces
(``python -m evals forecast --write``); :meth:`ForecastModel.p_leader`
combines it with the vote's own prediction (the posterior chance the next
path votes for the leader, :meth:`AnswerPrior.leader_share`).
:func:`flip_with_running` is the ``bayes`` rule's flip probability when
some of the started paths are still running: a mixture over how they end,
each a vote for the leader with its forecast and otherwise, conservatively,
a vote for the runner-up.  With no evidence (early in a path) the forecast
is the vote's own prediction, and the rule is the one without forecasts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Callable, Iterable, Sequence

import numpy as np

from ..voting.answers import DEFAULT_TIMEOUT_S, answers_equal, extract_answer
from ..voting.vote import cluster_answers
from .answer_prior import AnswerPrior
from .stopping import StopRule, tally

__all__ = ["PROGRESS_BANDS", "STATES", "ForecastModel", "ForecastScore", "InFlightCheck", "evidence",
           "flip_with_running", "leader_votes"]

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
        """The shipped model (``forecast.json``, fitted on recorded traces)."""
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


@dataclass
class ForecastScore:
    """How a run's forecasts did, checked on the paths that finished after
    one was made: mean log loss of P(ends on the leader) against the
    outcome, beside the vote's own chance alone (no text read).  Lower is
    better; a forecast that does not beat its own baseline here is not
    helping on this model."""

    paths: int = 0
    loss: float = 0.0
    loss_without: float = 0.0

    def add(self, chance: float, base: float, on_leader: bool) -> None:
        def log_loss(q: float) -> float:
            q = min(max(q, 1e-6), 1.0 - 1e-6)
            return -math.log(q if on_leader else 1.0 - q)
        self.paths += 1
        self.loss += log_loss(chance)
        self.loss_without += log_loss(base)

    def as_dict(self) -> dict:
        n = max(self.paths, 1)
        return {"paths": self.paths, "log_loss": round(self.loss / n, 4),
                "log_loss_without": round(self.loss_without / n, 4)}


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
        self.last_chances: list[float] | None = None  # the last vote's forecasts, if it read them
        self.last_base, self.last_leader = 0.0, None  # that vote's own chance, and its leader
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
        self.last_chances = None
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
        self.last_chances = chances  # run-ahead weighs them (PathBook.running_forecast)
        self.last_base, self.last_leader = base, leader
        return flip_with_running(self.prior, lead, second, other, chances, unstarted, length) <= error


@lru_cache(maxsize=1)
def _default() -> ForecastModel:
    text = resources.files("consensus_spec.sampling").joinpath("forecast.json").read_text()
    return ForecastModel.from_json(json.loads(text))
