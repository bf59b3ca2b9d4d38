"""One self-consistency run's bookkeeping (pure logic, no vLLM): the
:class:`PathBook` both engine loops share.

It holds the :class:`~consensus_spec.sampling.waves.PathPlanner`, each
running path's output, the finished samples, the cancelled paths' tokens
and the stop rule's prior.  The loops (:func:`~consensus_spec.sampling.engine_loop.run_paths`,
:func:`~consensus_spec.sampling.async_loop.run_paths_async`) only move
outputs in and requests out.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ..voting.confidence import confidence_weights
from ..voting.vote import VoteResult, logprob_weights, majority_vote
from .answer_prior import AnswerPrior
from .options import Voting
from .results import ProblemResult, Sample, SelfConsistencyRun
from .stopping import PEERS, StopRule
from .stopping import should_stop as rule_says_stop
from .waves import PathPlanner, Schedule

__all__ = ["PathBook"]

DECIDED = StopRule(kind="decided")


def _tokens_saved(finished_lengths: list[int], cancelled_progress: list[int], max_tokens: int) -> int:
    """Estimate of tokens not generated thanks to early stop: each cancelled
    path is assumed to have needed the problem's mean finished length
    (``max_tokens`` if none finished), minus what it had already produced."""
    expected = sum(finished_lengths) / len(finished_lengths) if finished_lengths else max_tokens
    return int(round(sum(max(0.0, expected - done) for done in cancelled_progress)))


class _Accumulator:
    """Collects one request's output; handles DELTA and FINAL_ONLY outputs.
    ``keep``: also its token ids and logprobs (for a response that returns them)."""

    __slots__ = ("texts", "num_tokens", "cumulative_logprob", "finish_reason", "stop_reason",
                 "token_ids", "logprobs")

    def __init__(self, keep: bool = False) -> None:
        self.texts: list[str] = []
        self.num_tokens = 0
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.token_ids: list[int] | None = [] if keep else None
        self.logprobs: list | None = [] if keep else None

    def update(self, completion, delta: bool) -> None:
        if delta:
            self.texts.append(completion.text)
            self.num_tokens += len(completion.token_ids)
        else:
            self.texts = [completion.text]
            self.num_tokens = len(completion.token_ids)
        if self.token_ids is not None:
            if not delta:
                self.token_ids, self.logprobs = [], []
            self.token_ids.extend(completion.token_ids)
            if completion.logprobs:
                self.logprobs.extend(completion.logprobs)
        self.cumulative_logprob = completion.cumulative_logprob  # running total
        self.finish_reason = completion.finish_reason
        self.stop_reason = getattr(completion, "stop_reason", None)

    @property
    def text(self) -> str:
        return "".join(self.texts)


class PathBook:
    """One run's bookkeeping, shared by :func:`run_paths` (step-driven) and
    :func:`~consensus_spec.sampling.async_loop.run_paths_async` (an async
    engine client): the planner, each running path's output, the finished
    samples, the cancelled paths' tokens, and the results.

    The loops only move outputs in and requests out: :meth:`admit` and
    :meth:`finish` return the (problem, path) keys to submit and to abort.
    ``on_vote(problem, answers, remaining, stop)`` is told every stop vote
    the planner takes (e.g. to stream it); ``idle_rows`` and ``run_ahead``
    go to the planner; ``keep_outputs`` keeps each path's token ids and
    logprobs in its :class:`Sample`.  ``prior``: the run's
    :class:`AnswerPrior` for a ``bayes`` rule (default: a new learning one);
    every problem's final vote is shown to it as soon as it is known.
    """

    def __init__(self, num: int, n: int, schedule: Schedule, stop_rule: StopRule | None,
                 voting: Voting, max_tokens: int,
                 on_vote: Callable[[int, list, int, bool], None] | None = None,
                 idle_rows: Callable[[], int] | None = None, run_ahead: Any = None,
                 keep_outputs: bool = False, prior: AnswerPrior | None = None):
        self.n, self.schedule, self.stop_rule, self.voting = n, schedule, stop_rule, voting
        if prior is None and stop_rule is not None and stop_rule.kind == "bayes":
            prior = AnswerPrior.learning()
        self.prior = prior
        if run_ahead is not None and getattr(run_ahead, "prior", None) is None:
            run_ahead.prior = prior
        self._votes: dict[int, tuple[VoteResult, list[float] | None]] = {}  # final votes
        self.keep_outputs = keep_outputs
        self.max_tokens = max_tokens
        self.samples: dict[int, dict[int, Sample]] = {i: {} for i in range(num)}
        self.accs: dict[tuple[int, int], _Accumulator] = {}  # running paths
        self.aborted: dict[int, dict[int, _Accumulator]] = {}  # may still get a final output
        self.last_look: dict[int, tuple[int, int]] = {}  # problem -> (paths voted, remaining) at its last vote

        def stop_check(p: int, answers: list, remaining: int) -> bool:
            stop = rule_says_stop(answers, remaining, stop_rule, prior=self.prior,
                                  timeout_s=voting.timeout_s)
            self.last_look[p] = (len(answers), remaining)
            if on_vote is not None:
                on_vote(p, answers, remaining, stop)
            return stop

        self.planner = PathPlanner(num, n, schedule, stop_check if stop_rule is not None else None,
                                   idle_rows, run_ahead)
        self.decided: set[int] = set()  # problems a vote no remaining path could change stopped
        if stop_rule is not None and stop_rule.kind not in PEERS:
            def decided_check(p: int, answers: list, remaining: int) -> bool:
                # every rule of ours stops once the full-n vote is decided; that holds in any
                # order, so paths finished past the voted prefix count too (all-at-once runs)
                if not rule_says_stop(answers, remaining, DECIDED, timeout_s=voting.timeout_s):
                    return False
                self.last_look[p] = (len(answers), remaining)
                self.decided.add(p)
                if on_vote is not None:
                    on_vote(p, answers, remaining, True)
                return True
            self.planner.decided_check = decided_check

    def admit(self) -> list[tuple[int, int]]:
        """Paths to submit now (see :meth:`PathPlanner.admit`)."""
        return self._started(self.planner.admit())

    def update(self, key: tuple[int, int], completion, delta: bool) -> bool:
        """Add one output of a running path; False if the path is not running
        (not ours, or already aborted).  An aborted path's late output (the
        final output an async engine sends on abort) still counts its tokens."""
        acc = self.accs.get(key)
        if acc is None:
            late = self.aborted.get(key[0], {}).get(key[1])
            if late is not None:
                late.update(completion, delta)
            return False
        acc.update(completion, delta)
        return True

    def finish(self, key: tuple[int, int]) -> tuple[list, list]:
        """A running path finished: record it, vote; (to submit, to abort)."""
        if key not in self.accs:
            return [], []  # aborted by an earlier finish
        p, k = key
        acc = self.accs.pop(key)
        self.samples[p][k] = Sample(k, acc.text, self.voting.extract(acc.text), acc.num_tokens,
                                    acc.cumulative_logprob, acc.finish_reason, acc.stop_reason,
                                    acc.token_ids, acc.logprobs or None)
        to_submit, to_abort = self.planner.on_finish(p, k, self.samples[p][k].answer)
        self._abort(to_abort)
        self._final_vote(p)
        return self._started(to_submit), to_abort

    def _abort(self, keys: list[tuple[int, int]]) -> None:
        for a in keys:
            self.aborted.setdefault(a[0], {})[a[1]] = self.accs.pop(a)

    def _final_vote(self, p: int) -> None:
        """Once problem ``p``'s vote is final, take it and show it to the prior."""
        if self.prior is not None and self.planner.done(p) and p not in self._votes:
            vote = self._votes[p] = self.vote_of(p)
            done = self._finished(p)
            self.prior.observe([c.count for c in vote[0].classes], vote[0].num_abstained,
                               sum(x.num_tokens for x in done) / len(done) if done else None)

    def _started(self, paths: list[tuple[int, int]]) -> list[tuple[int, int]]:
        keep = self.keep_outputs or self.voting.needs_token_logprobs
        for key in paths:
            self.accs[key] = _Accumulator(keep)
        return paths

    def done(self, p: int) -> bool:
        return self.planner.done(p)

    def _finished(self, p: int) -> list[Sample]:
        return [self.samples[p][k] for k in sorted(self.samples[p])]

    def vote_of(self, p: int,
                done: list[Sample] | None = None) -> tuple[VoteResult, list[float] | None]:
        done = self._finished(p) if done is None else done
        weights = None
        if self.voting.needs_token_logprobs:
            weights = confidence_weights([s.logprobs for s in done], self.voting.confidence_keep,
                                         self.voting.confidence_window)
        elif self.voting.weighted:  # a zero-token path has no mean logprob: weight 0
            lps = [-math.inf if s.mean_logprob is None else s.mean_logprob for s in done]
            weights = logprob_weights(lps, self.voting.weight_method)
        return majority_vote([s.answer for s in done], weights, self.voting.timeout_s), weights

    def result(self, p: int) -> ProblemResult:
        done = self._finished(p)
        vote, weights = self._votes[p] if p in self._votes else self.vote_of(p, done)
        # cancelled: the aborted paths, and at 0 tokens the paths a stop left unsent
        cancelled = [acc.num_tokens for acc in self.aborted.get(p, {}).values()]
        if p in self.planner.stopped:
            cancelled += [0] * self.planner.num_unsent(p)
        return ProblemResult(
            index=p,
            vote=vote,
            samples=done,
            num_aborted=len(cancelled),
            aborted_tokens=sum(cancelled),
            est_tokens_saved=_tokens_saved([s.num_tokens for s in done], cancelled, self.max_tokens),
            stopped_early=p in self.planner.stopped,
            weights=weights,
            waves=self.planner.waves_started(p),
            num_sent=self.n - self.planner.num_unsent(p),
            stopped_after=self.last_look[p][0] if p in self.planner.stopped else None,
            decided=p in self.decided,
        )

    def run(self, wall: float, steps: int = 0, inflight_sum: int = 0) -> SelfConsistencyRun:
        results = [self.result(p) for p in range(len(self.samples))]
        cap = self.schedule.capacity
        mean_inflight = inflight_sum / steps if steps else 0.0
        config = dict(n=self.n, schedule=self.schedule.describe(), capacity=cap,
                      stop_rule=self.stop_rule.describe() if self.stop_rule else "off",
                      weighted=self.voting.weighted, weight_method=self.voting.weight_method,
                      max_tokens=self.max_tokens)
        return SelfConsistencyRun(results, None, wall, config, engine_steps=steps,
                                  mean_inflight=mean_inflight,
                                  batch_fill=mean_inflight / cap if cap else None)
