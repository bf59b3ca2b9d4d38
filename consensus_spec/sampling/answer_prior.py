"""How a run's problems split their answers, and the chance a vote still flips
(pure logic: numpy and scipy, no vLLM).

Model.  A problem's paths answer with some shares; call the two largest
p1 >= p2.  Everything else (other answers, paths with no answer) is spread
thin: none of it can win.  An :class:`AnswerPrior` is a distribution over
(p1, p2) on a grid.  A problem whose vote counts ``lead`` for its leader,
``second`` for the runner-up and ``other`` for the rest has a posterior over
that grid (either way round: the leader may hold p1 or p2, and an answer not
seen yet may hold either share), and the ``remaining`` paths are drawn from
it.  :meth:`AnswerPrior.flip_probability` is the chance that the runner-up
(or an answer not seen yet) then ends *strictly* ahead of the leader: a tie
in the full-N vote counts as no flip.

Difficulty.  What the grid's weights should be depends on the model and the
task: on an easy set two agreeing paths almost settle a vote, on a hard one
they do not.  The shipped prior (``answer_prior.json``) was fitted on
recorded traces (``python -m evals stop-rules --write-prior``).  A run
learns how far its own problems differ from it: :meth:`AnswerPrior.observe`
takes each finished problem's vote, and the weights are tilted by
exp(lambda * p1), with lambda fitted to every finished problem's votes by
maximum likelihood (a Gaussian penalty keeps it near 0 while few problems
have finished).  One parameter, because a run's stopped problems say little
about what the paths after a stop would have said: a free-form prior fitted
to them drifts towards "easier than it is", a one-parameter tilt is pinned
by the first paths of every problem.

A caller who feeds problems one at a time keeps one prior for the run:

    prior = AnswerPrior.learning()
    for problem in problems:
        ...  # should_stop(answers, remaining, prior=prior) after each path
        prior.observe(final_answers)
"""

from __future__ import annotations

import itertools
import json
import operator
import threading
from collections import Counter, deque
from functools import lru_cache
from importlib import resources
from typing import Iterable, Sequence

import numpy as np

__all__ = ["AnswerPrior", "GRID_STEP", "overtake"]

GRID_STEP = 0.025  # grid spacing of (p1, p2)
MIX_UNIFORM = 0.02  # share of the fitted prior spread evenly: no split is ruled out
MIX_PSEUDO = 20.0  # problems' worth of weight the shipped mixture keeps against a run's
SHARE_BANDS = (0.5, 0.7, 0.85, 0.95)  # the leader's share: where fit() cuts its components
LENGTH_BANDS_AFTER = 40  # problems with a length before a run weighs them by path length
MAX_PROBLEMS = 4096  # finished problems a learning prior remembers (a bound for long runs)
CACHE_SIZE = 1 << 15
_TOKENS = itertools.count()


@lru_cache(maxsize=None)
def _grid(step: float = GRID_STEP) -> tuple[np.ndarray, np.ndarray]:
    """Every (p1, p2) with p1 >= p2 >= 0 and p1 + p2 <= 1, at ``step``."""
    cells = round(1.0 / step)
    p1, p2 = [], []
    for i in range(1, cells + 1):
        for j in range(0, min(i, cells - i) + 1):
            p1.append(i / cells)
            p2.append(j / cells)
    return np.array(p1), np.array(p2)


def _shape(counts: Sequence[int], total: int) -> tuple[int, int, int]:
    """(leader's votes, runner-up's, everything else) of a vote over ``total`` paths."""
    ranked = sorted(counts, reverse=True)
    lead = ranked[0] if ranked else 0
    second = ranked[1] if len(ranked) > 1 else 0
    return lead, second, total - lead - second


class AnswerPrior:
    """A prior over the shares of a problem's two most common answers: a
    mixture of ``components`` (each a distribution over the grid cells of
    :data:`GRID_STEP`; :meth:`fit` makes one per band of the leader's share).

    ``mix``: the components' weights (default: alike).  ``learn``: refit the
    weights to the problems :meth:`observe` is given, per band of path
    length (module docstring); a prior that does not learn ignores them.
    Safe to share between threads.
    """

    def __init__(self, components, mix: Sequence[float] | None = None, *, learn: bool = False):
        p1, p2 = _grid()
        comps = np.atleast_2d(np.asarray(components, dtype=float))
        if comps.shape[1:] != p1.shape or not np.all(np.isfinite(comps)) or np.any(comps < 0) \
                or np.any(comps.sum(axis=1) <= 0):
            raise ValueError(f"AnswerPrior components need {p1.size} finite weights >= 0 each, not all 0")
        mix = np.ones(len(comps)) if mix is None else np.asarray(mix, dtype=float)
        if mix.shape != (len(comps),) or not np.all(np.isfinite(mix)) or np.any(mix < 0) or mix.sum() <= 0:
            raise ValueError(f"AnswerPrior mix needs {len(comps)} finite weights >= 0, not all 0")
        self.components = comps / comps.sum(axis=1, keepdims=True)
        self.base_mix = mix / mix.sum()
        self.learn = bool(learn)
        self._p1, self._p2 = p1, p2
        self._logs = (np.log(np.maximum(p1, 1e-300)), np.log(np.maximum(p2, 1e-300)),
                      np.log(np.maximum(1.0 - p1 - p2, 1e-300)))
        self._lock = threading.Lock()
        self._seen: deque = deque(maxlen=MAX_PROBLEMS)  # (shape, mean path length or None)
        self._since_fit = 0
        self.edges: np.ndarray | None = None  # path-length band edges, once learned
        self.mix = self.base_mix[None, :]  # [length band, component]
        self.weights = self.mix @ self.components  # [length band, cell]
        self.version = 0  # bumps when the weights change
        self._token = next(_TOKENS)
        self._cache: dict = {}

    # -- construction ---------------------------------------------------------

    @classmethod
    def default(cls) -> "AnswerPrior":
        """The shipped prior (fitted on recorded traces); shared, does not learn."""
        return _default()

    @classmethod
    def learning(cls, base: "AnswerPrior | None" = None) -> "AnswerPrior":
        """A prior for one run: ``base`` (default: the shipped one), its
        mixture refitted to the problems it is shown."""
        base = base or _default()
        return cls(base.components, base.base_mix, learn=True)

    @classmethod
    def uniform(cls, *, learn: bool = False) -> "AnswerPrior":
        """Every cell alike, in the bands :meth:`fit` makes."""
        return cls._banded(np.ones(_grid()[0].size), learn=learn)

    @classmethod
    def _banded(cls, w: np.ndarray, *, learn: bool = False) -> "AnswerPrior":
        p1 = _grid()[0]
        band = np.digitize(p1, SHARE_BANDS, right=True)
        comps = [np.where(band == b, w, 0.0) for b in range(len(SHARE_BANDS) + 1)]
        keep = [c for c in comps if c.sum() > 0]
        return cls(keep, [c.sum() for c in keep], learn=learn)

    @classmethod
    def fit(cls, votes: Iterable[tuple[Sequence[int], int]], *, iterations: int = 500,
            mix_uniform: float = MIX_UNIFORM) -> "AnswerPrior":
        """The prior that best explains whole problems' votes (nonparametric
        maximum likelihood by EM over the grid), ``mix_uniform`` of it spread
        evenly, cut into bands of the leader's share (:data:`SHARE_BANDS`)
        that a run reweighs.  ``votes``: per problem, (paths per answer
        class, paths with no answer)."""
        shapes = Counter(_shape(list(counts), sum(counts) + none) for counts, none in votes)
        if not shapes:
            raise ValueError("AnswerPrior.fit needs at least one problem")
        keys = list(shapes)
        like = cls.uniform()._likelihoods(keys)  # [shape, cell]
        mult = np.array([shapes[k] for k in keys], dtype=float)
        w = np.full(like.shape[1], 1.0 / like.shape[1])
        for _ in range(iterations):
            post = like * w
            post /= post.sum(axis=1, keepdims=True)
            w = mult @ post / mult.sum()
        return cls._banded((1.0 - mix_uniform) * w + mix_uniform / w.size)

    def to_json(self) -> dict:
        return {"grid_step": GRID_STEP, "mix": [round(float(x), 8) for x in self.base_mix],
                "components": [[round(float(x), 8) for x in c] for c in self.components]}

    @classmethod
    def from_json(cls, obj: dict, *, learn: bool = False) -> "AnswerPrior":
        if not isinstance(obj, dict) or obj.get("grid_step") != GRID_STEP:
            raise ValueError(f"an AnswerPrior JSON has grid_step {GRID_STEP}, mix and components")
        return cls(obj["components"], obj.get("mix"), learn=learn)

    # -- learning -------------------------------------------------------------

    def observe(self, counts: Sequence[int], no_answer: int = 0, length: float | None = None) -> None:
        """A finished problem's vote: paths per answer class (any order),
        paths with no answer, and the mean length of its paths (tokens; None:
        not known).  Only a learning prior uses it."""
        if not self.learn:
            return
        counts = [operator.index(c) for c in counts]
        if any(c < 0 for c in counts) or no_answer < 0:
            raise ValueError("vote counts must be >= 0")
        if length is not None and not (isinstance(length, (int, float)) and length >= 0):
            raise ValueError(f"length must be a number >= 0 or None, got {length!r}")
        with self._lock:
            self._seen.append((_shape(counts, sum(counts) + no_answer), length))
            self._since_fit += 1

    @property
    def key(self) -> tuple[int, int]:
        """Names these weights for a cache that must not hold the prior itself."""
        return self._token, self.version

    @property
    def problems_seen(self) -> int:
        return len(self._seen)

    def sizes(self) -> dict[str, list[int]]:
        """What it holds: [entries, bound] (a server reports them)."""
        return {"prior_problems": [len(self._seen), self._seen.maxlen or 0],
                "prior_flips": [len(self._cache), CACHE_SIZE]}

    def _refit(self) -> None:
        """Refit the mixture when enough new problems came in (a tenth more;
        lock held): per band of path length (quartiles of the run's problems,
        once LENGTH_BANDS_AFTER have lengths), EM over the components'
        weights, the shipped weights counting as MIX_PSEUDO problems."""
        seen = len(self._seen)
        if self._since_fit == 0 or self._since_fit < max(1, seen // 10) or len(self.components) < 2:
            return
        lengths = np.array([x for _, x in self._seen if x is not None], dtype=float)
        edges = None
        if len(lengths) >= LENGTH_BANDS_AFTER:
            edges = np.unique(np.quantile(lengths, (0.25, 0.5, 0.75)))
        keys = sorted({shape for shape, _ in self._seen})
        index = {k: i for i, k in enumerate(keys)}
        like = self._likelihoods(keys) @ self.components.T  # [shape, component]
        bands = 1 if edges is None else len(edges) + 1
        counts = np.zeros((bands, len(keys)))
        for shape, length in self._seen:
            band = 0 if edges is None or length is None else int(np.searchsorted(edges, length))
            counts[band, index[shape]] += 1
        mix = np.empty((bands, len(self.components)))
        for b in range(bands):
            m = self.base_mix
            for _ in range(100):
                post = like * m
                post /= post.sum(axis=1, keepdims=True) + 1e-300
                m = (counts[b] @ post + MIX_PSEUDO * self.base_mix) / (counts[b].sum() + MIX_PSEUDO)
            mix[b] = m
        self.edges, self.mix = edges, mix
        self.weights = mix @ self.components
        self._since_fit = 0
        self.version += 1
        self._cache.clear()

    # -- the flip ---------------------------------------------------------------

    def _branches(self, lead: int, second: int, other: int) -> list[tuple[np.ndarray, int, int]]:
        """The ways the vote can have come about: (log-likelihood per cell,
        the gap the runner-up must close, 0 if the leader holds p1 else 1).
        The runner-up holds the other share; seen once, it may instead be
        one of the scattered answers, and the other share is not seen yet."""
        l1, l2, lr = self._logs
        out = [(lead * l1 + second * l2 + other * lr, lead - second, 0),
               (lead * l2 + second * l1 + other * lr, lead - second, 1)]
        if second == 1:
            out += [(lead * l1 + (other + 1) * lr, lead, 0), (lead * l2 + (other + 1) * lr, lead, 1)]
        return out

    def _posterior(self, lead: int, second: int, other: int,
                   weights: np.ndarray) -> list[tuple[np.ndarray, int, int]]:
        """Each of :meth:`_branches` as (unnormalised posterior weight per
        cell, gap, way), scaled by one common factor."""
        branches = self._branches(lead, second, other)
        top = max(b[0].max() for b in branches)
        return [(weights * np.exp(log - top), gap, way) for log, gap, way in branches]

    def _likelihoods(self, shapes: list[tuple[int, int, int]]) -> np.ndarray:
        """[shape, cell] likelihood up to a factor per shape (every way round)."""
        rows = []
        for shape in shapes:
            logs = [b[0] for b in self._branches(*shape)]
            top = max(x.max() for x in logs)
            rows.append(sum(np.exp(x - top) for x in logs))
        return np.array(rows)

    def flip_probability(self, lead: int, second: int, other: int, remaining: int,
                         length: float | None = None) -> float:
        """P(after ``remaining`` more paths the runner-up, or an answer not
        seen yet, holds strictly more votes than the current leader).

        ``lead`` >= ``second``: votes of the leader and the runner-up so far;
        ``other``: every other path seen (other answers, no answer);
        ``length``: the mean length of the problem's paths so far (tokens),
        which a learning prior weighs once its run has taught it how."""
        lead, second, other, remaining = (operator.index(x) for x in (lead, second, other, remaining))
        if min(second, other, remaining) < 0 or lead < second:
            raise ValueError("need lead >= second >= 0, other >= 0 and remaining >= 0")
        if lead - second >= remaining:
            return 0.0  # the runner-up can at best draw level
        key = (lead, second, other, remaining)
        hit, weights, version, key = self._cached(key, length)
        if hit is not None:
            return hit
        flip = total = 0.0
        for w, gap, way in self._posterior(lead, second, other, weights):
            flip += float(w @ overtake(gap, remaining)[way])
            total += float(w.sum())
        return self._remember(key, version, min(1.0, max(0.0, flip / total)))

    def leader_share(self, lead: int, second: int, other: int, length: float | None = None) -> float:
        """The posterior mean of the leader's share: the chance that the
        next path votes for the leader (arguments as :meth:`flip_probability`)."""
        lead, second, other = (operator.index(x) for x in (lead, second, other))
        if min(second, other) < 0 or lead < second:
            raise ValueError("need lead >= second >= 0 and other >= 0")
        hit, weights, version, key = self._cached(("share", lead, second, other), length)
        if hit is not None:
            return hit
        share = total = 0.0
        for w, _, way in self._posterior(lead, second, other, weights):
            share += float(w @ (self._p2 if way else self._p1))
            total += float(w.sum())
        return self._remember(key, version, min(1.0, max(0.0, share / total)))

    def _cached(self, key: tuple, length: float | None):
        """(cached value or None, weights for ``length``, version, full key)."""
        with self._lock:
            if self.learn:
                self._refit()
            band = 0 if self.edges is None or length is None else int(np.searchsorted(self.edges, length))
            if self.edges is not None and length is None:
                band = -1  # no length: the run's problems alike
            key = (*key, band)
            weights = self.weights.mean(axis=0) if band == -1 else self.weights[band]
            return self._cache.get(key), weights, self.version, key

    def _remember(self, key: tuple, version: int, value: float) -> float:
        with self._lock:
            if len(self._cache) >= CACHE_SIZE:
                self._cache.clear()
            if version == self.version:
                self._cache[key] = value
        return value


@lru_cache(maxsize=2048)  # about 14 MB at most
def overtake(d: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Per grid cell, P(the runner-up gains more than ``d`` on the leader in
    ``m`` more paths), with the leader holding p1 and the runner-up p2, and
    the other way round.  For shares (a, b): condition on T, the paths that
    go to either, ~ Bin(m, a + b); given T = t the runner-up's ~ Bin(t, b /
    (a + b)) must exceed (t + d) / 2."""
    from scipy.special import bdtrc
    from scipy.stats import binom

    p1, p2 = _grid()
    s = p1 + p2
    t = np.arange(m + 1)
    k = (t + d) // 2
    total = binom.pmf(t[None, :], m, s[:, None])
    out = []
    for b in (p2, p1):
        q = np.divide(b, s, out=np.zeros_like(s), where=s > 0)
        over = np.where(k[None, :] < t[None, :],
                        bdtrc(np.minimum(k, t)[None, :], t[None, :], q[:, None]), 0.0)
        out.append((total * np.nan_to_num(over)).sum(axis=1))
    return out[0], out[1]


@lru_cache(maxsize=1)
def _default() -> AnswerPrior:
    text = resources.files("consensus_spec.sampling").joinpath("answer_prior.json").read_text()
    return AnswerPrior.from_json(json.loads(text))

