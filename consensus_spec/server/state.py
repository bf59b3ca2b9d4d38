"""The self-consistency routes' per-server state (``GET
/v1/self_consistency/state`` shows it): the engine client, limits and
defaults, the runs in flight, the answer prior every run votes with, what
stopping saved, and the engine's load a request's schedule is chosen by
(:mod:`consensus_spec.sampling.load_policy`)."""

from __future__ import annotations

from argparse import Namespace
from collections import Counter, deque
from typing import Callable

from ..sampling import run_ahead, stopping
from ..sampling.answer_prior import AnswerPrior
from ..sampling.load_policy import EngineLoad, ScheduleChoice, choose_schedule, requested
from ..sampling.results import StoppingTotals
from ..sampling.run_ahead import RunAheadStats
from ..sampling.waves import Schedule
from ..voting import answers
from .options import Limits
from .runs import tasks_held

__all__ = ["ServerState"]

ANSWER_TIMES = 64  # recent problems whose time to answer says when a run is late


class ServerState:
    """Per-server state: the engine client, limits, the live runs (counted
    for ``GET /v1/self_consistency/state`` and the soak test), and the
    load a request's schedule is chosen by."""

    def __init__(self, engine_client, args: Namespace, limits: Limits, max_num_seqs: int,
                 defaults: dict | None = None, run_ahead: str = "throughput", costs=None,
                 renderer=None):
        self.engine = engine_client
        self.limits = limits
        self.max_num_seqs = max_num_seqs
        self.defaults = defaults or {}
        self.run_ahead_mode = run_ahead
        self.measured_run_ahead = run_ahead != "idle"
        self.costs = costs  # EngineStepCosts (step_costs.py)
        if costs is not None:  # what the engine's rows held beyond ours at each step
            costs.own_rows = lambda: sum(self.runs.values())
        self.renderer = renderer  # vLLM's OnlineRenderer (the OpenAI-shaped routes)
        self.run_ahead_total = RunAheadStats()
        mc = engine_client.model_config
        self.default_sampling_params = mc.get_diff_sampling_param()  # as vLLM's routes take them
        self.override_max_tokens = (
            self.default_sampling_params.get("max_tokens")
            if getattr(mc, "generation_config", "auto") not in ("auto", "vllm")
            else (getattr(mc, "override_generation_config", None) or {}).get("max_new_tokens"))
        model = getattr(args, "model", None)
        names = getattr(args, "served_model_name", None) or ([model] if model else [])
        self.model_names = [names] if isinstance(names, str) else list(names)
        self.max_model_len = engine_client.model_config.max_model_len
        parallel = getattr(getattr(engine_client, "vllm_config", None), "parallel_config", None)
        self.data_parallel_size = int(getattr(parallel, "data_parallel_size", 1) or 1)
        self.chat_template = getattr(args, "chat_template", None)
        self.runs: dict[str, int] = {}  # run id -> paths in the engine now
        self.client_ids: dict[str, str] = {}  # run id -> the client's X-Request-Id
        self.wants: dict[str, Callable[[], int]] = {}  # run id -> rows its idle fill would take
        self.problems: dict[str, list[int]] = {}  # run id -> [problems not yet answered, n]
        # requests parsed whose runs have not chosen a schedule yet (a burst of arrivals)
        self.pending: dict[str, list[int]] = {}  # run id -> [problems, n]
        self.schedules = Counter()  # mode -> requests run so
        self.last_schedule: dict | None = None
        self.answer_times: deque[float] = deque(maxlen=ANSWER_TIMES)  # seconds, recent problems
        self.requests_total = 0
        self.requests_unfinished = 0  # failed, or cancelled by a client that left
        # one prior for every run: the server learns how its traffic's problems split
        self.prior = AnswerPrior.learning()
        self.stopping = StoppingTotals()

    def idle_rows(self, run_id: str) -> int:
        """Rows ``run_id``'s idle fill may open early waves into: the batch
        rows no self-consistency path holds (other routes' requests are not
        counted); with ``idle_fill="oldest"``, less what older runs would take
        first (the runs still going are the problems whose votes have not
        settled: a shorter tail of latency, at some throughput)."""
        held = sum(self.runs.values())
        if self.costs is not None and self.costs.measured:  # every route's rows, not only ours
            held = max(held, self.costs.rows())
        idle = self.max_num_seqs - held
        if self.limits.idle_fill != "oldest":
            return idle
        for other, wanted in self.wants.items():  # oldest first
            if other == run_id or idle <= 0:
                break
            idle -= wanted()
        return idle

    def load(self) -> EngineLoad:
        """The engine's load now: its rows and queue at its last step (every
        route's, when the step-cost logger measures them; else this
        endpoint's own paths), the problems this endpoint has in flight;
        with data parallelism, the rows of every engine (problems spread
        over them by their prompts' hash)."""
        measured = self.costs is not None and self.costs.measured
        busy = self.costs.rows() if measured else sum(self.runs.values())
        counted = [*self.problems.values(), *self.pending.values()]
        return EngineLoad(
            max_rows=self.max_num_seqs * self.data_parallel_size, rows_busy=busy,
            waiting=self.costs.waiting() if measured else 0,
            other_rows=self.costs.other_rows() if measured else 0,
            problem_rows=sum(left * n for left, n in counted),
            problems_in_flight=sum(left for left, _ in counted),
            row_cost=self.costs.elasticity(max(1, busy), 1) if self.costs is not None else None)

    def arrived(self, run_id: str, problems: int, n: int) -> None:
        """A request was parsed: its problems count for the requests that
        choose a schedule before its own run does (the route pops it when done)."""
        self.pending[run_id] = [problems, n]

    def schedule_for(self, run_id: str, opts, problems: int, n: int) -> tuple[Schedule, ScheduleChoice]:
        """The schedule a run of ``problems`` problems of ``n`` paths runs with
        (``opts``: its :class:`~.options.RunOptions`), chosen by the load now
        unless named; the run's problems count as in flight from here on."""
        self.pending.pop(run_id, None)
        if opts.schedule_auto:
            schedule, choice = choose_schedule(self.load(), problems, n, opts.schedule)
        else:
            schedule, choice = opts.schedule, requested(opts.schedule, opts.stop_rule is not None)
        self.problems[run_id] = [problems, n]
        self.schedules[choice.mode] += 1
        self.last_schedule = choice.as_dict()
        return schedule, choice

    def problem_answered(self, run_id: str, seconds: float) -> None:
        left = self.problems.get(run_id)
        if left is not None and left[0] > 0:
            left[0] -= 1
        self.answer_times.append(seconds)

    def late(self, seconds: float) -> bool:
        """Whether a run going for ``seconds`` is later than the recent
        problems took on average (its waves then open sooner: run_ahead.py)."""
        times = self.answer_times
        return bool(times) and seconds > sum(times) / len(times)

    def snapshot(self, client_id: str | None = None) -> dict:
        """Counts; with ``client_id``, only the runs of requests that sent it
        as ``X-Request-Id`` (so a client can check that its run ended)."""
        if client_id is not None:
            mine = [r for r, c in self.client_ids.items() if c == client_id]
            return {"request_id": client_id, "requests_active": len(mine),
                    "paths_in_flight": sum(self.runs.get(r, 0) for r in mine)}
        return {"requests_active": len(self.runs), "paths_in_flight": sum(self.runs.values()),
                "client_ids_held": len(self.client_ids), "planners_held": len(self.wants),
                "tasks_held": tasks_held(),
                # memos the votes and run-ahead keep: [entries, bound]
                "caches": {**stopping.cache_sizes(), **run_ahead.cache_sizes(),
                           **answers.cache_sizes(), **self.prior.sizes()},
                "requests_total": self.requests_total,
                "requests_unfinished": self.requests_unfinished,
                "limits": {"max_n": self.limits.max_n, "max_prompts": self.limits.max_prompts,
                           "max_inflight": self.limits.max_inflight,
                           "idle_fill": self.limits.idle_fill},
                "defaults": self.defaults,
                "schedule": {"requests": dict(self.schedules), "last": self.last_schedule,
                             "problems_in_flight": sum(left for left, _ in self.problems.values()),
                             "requests_arriving": len(self.pending),
                             "recent_answer_s": round(sum(self.answer_times) / len(self.answer_times), 3)
                             if self.answer_times else None},
                "run_ahead": {"mode": self.run_ahead_mode,
                              **self.run_ahead_total.as_dict()},
                "stopping": {**self.stopping.as_dict(), "prior_problems_seen": self.prior.problems_seen},
                "step_costs": self.costs.summary() if self.costs is not None else None}
