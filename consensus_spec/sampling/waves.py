"""Wave scheduling of self-consistency paths (pure logic, no vLLM).

A problem's N paths run in *waves*: the first wave is submitted when the
problem is admitted, each later wave once every path of the previous one has
finished and the vote taken then did not stop the problem.  Waves of many
problems are pipelined: while a problem waits for its wave, the free engine
rows go to the next waves of other problems (oldest problem first) and then
to new problems, so the batch stays full up to ``capacity`` paths in flight.

:class:`Schedule` is the configuration, :class:`PathPlanner` turns finish
events into the (problem, path) requests to submit or abort.  The engine loop
that drives a real engine through it is :func:`consensus_spec.sampling.engine_loop.run_paths`.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

__all__ = ["ALL_AT_ONCE", "DEFAULT_WAVES", "REST", "PathPlanner", "Schedule"]

REST = "rest"
# Default waves: see Schedule's docstring for why.
DEFAULT_WAVES: tuple[int | str, ...] = (2,)
CHECKS = ("index", "wave", "path")
_FLAGS = {"no-fill": ("fill_idle", False), "path-check": ("check", "path"),
          "wave-check": ("check", "wave")}  # describe() suffixes


@dataclass(frozen=True)
class Schedule:
    """When a problem's paths run, and when its vote is checked.

    ``waves``: wave sizes, e.g. ``(4, 4, "rest")``; ``"rest"`` (only last)
    is every path not yet run; otherwise the last size repeats until N paths
    ran (``(4,)`` is waves of 4).  ``("rest",)`` runs all N at once.
    ``capacity``: paths in flight at most (None: unbounded;
    :func:`~consensus_spec.sampling.self_consistency.self_consistency` fills in the
    engine's ``max_num_seqs``).  ``check``: ``"index"`` takes the stop vote
    after every path *in path order*: the vote on paths 0..k-1 once each of
    them has finished, whichever finished first, and a stop aborts the
    problem's paths still running.  Paths finishing one by one arrive
    shortest first, which would bias the vote towards short answers; an
    order fixed before they run does not (the paths stay exchangeable).
    ``"wave"`` votes only after whole waves, so nothing of a problem is
    running when it stops; ``"path"`` checks after every finished path in
    finishing order (biased; kept for comparison).
    ``fill_idle``: once every problem has been admitted, rows that would sit
    idle start the next waves of running problems early (oldest first, one
    wave each per pass); the vote is still taken wave by wave, and paths of
    a problem that stops are aborted.  It trades a few tokens for the tail of
    a run: without it, the last problems' waves run one after another on a
    nearly empty batch.

    Default waves ``(2,)``, waves of 2 voted after every path in path
    order, with ``fill_idle``: the engine keeps two paths of a problem in
    flight and a stop can come after any path.  ``python -m evals waves
    --rows 64`` on the shared traces (3 path orders; projected H200 time
    from measured step costs, not a GPU run), the default stop rule and
    consensus drafting: 63.0% of the tokens and 2.07x on gsm8k n=8, 20.2%
    and 6.14x on addsub n=40; voting only after whole waves
    (``check="wave"``): 64.9% and 20.6% (docs/stopping.md).
    """

    waves: tuple[int | str, ...] = DEFAULT_WAVES
    capacity: int | None = None
    check: str = "index"
    fill_idle: bool = True

    def __post_init__(self) -> None:
        waves = self.waves
        if isinstance(waves, (str, int)) or not isinstance(waves, Sequence):
            raise ValueError(f"Schedule.waves must be a sequence of sizes, got {waves!r}")
        waves = tuple(waves)
        if not waves:
            raise ValueError("Schedule.waves must not be empty")
        for i, w in enumerate(waves):
            if w == REST:
                if i != len(waves) - 1:
                    raise ValueError("Schedule.waves: 'rest' may only be the last wave")
            elif isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ValueError(f"Schedule.waves: sizes must be ints >= 1 or a final 'rest', got {w!r}")
        object.__setattr__(self, "waves", waves)
        cap = self.capacity
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"Schedule.capacity must be None or an int >= 1, got {cap!r}")
        if self.check not in CHECKS:
            raise ValueError(f"Schedule.check must be one of {CHECKS}, got {self.check!r}")
        if not isinstance(self.fill_idle, bool):
            raise ValueError(f"Schedule.fill_idle must be a bool, got {self.fill_idle!r}")

    @classmethod
    def parse(cls, spec: str, **kwargs) -> "Schedule":
        """``"4,4,rest"`` or ``"all"`` (one wave) -> Schedule (for command lines);
        the suffixes :meth:`describe` writes (``+no-fill``, ``+path-check``)
        set ``fill_idle`` and ``check``."""
        text = spec.strip().lower()
        text, *flags = text.split("+")
        for flag in flags:
            if flag not in _FLAGS:
                raise ValueError(f"unknown schedule flag +{flag}; known: "
                                 + ", ".join("+" + f for f in _FLAGS))
            kwargs.setdefault(*_FLAGS[flag])
        if text in ("all", REST):
            return cls(waves=(REST,), **kwargs)
        parts = [p.strip() for p in text.replace(" ", ",").split(",") if p.strip()]
        waves = tuple(p if p == REST else int(p) if p.isdigit() else p for p in parts)
        return cls(waves=waves, **kwargs)

    def sizes(self, n: int) -> list[int]:
        """Concrete wave sizes for ``n`` paths (they sum to ``n``)."""
        out, done, i = [], 0, 0
        while done < n:
            w = self.waves[min(i, len(self.waves) - 1)]
            size = n - done if w == REST else min(w, n - done)
            out.append(size)
            done += size
            i += 1
        return out

    @property
    def all_at_once(self) -> bool:
        return self.waves == (REST,)

    @property
    def may_abort(self) -> bool:
        """Whether a stop can find paths of the problem still running."""
        return self.check != "wave" or (self.fill_idle and not self.all_at_once)

    def describe(self) -> str:
        """``"4,4,rest"``, ``"all"``; ``"+no-fill"`` without idle fill,
        ``"+wave-check"`` / ``"+path-check"`` for those checks (:meth:`parse`
        reads it back)."""
        text = "all" if self.all_at_once else ",".join(str(w) for w in self.waves)
        if not self.fill_idle and not self.all_at_once:
            text += "+no-fill"
        return text + ("" if self.check == "index" else f"+{self.check}-check")


ALL_AT_ONCE = Schedule(waves=(REST,))

StopCheck = Callable[[int, list, int], bool]


class Progress(NamedTuple):
    """A running problem's paths (:meth:`PathPlanner.progress`)."""

    finished: list[int]
    answers: list[Any]
    running: list[int]
    not_started: int


class _Problem:
    __slots__ = ("wave", "opened", "next_path", "inflight", "answers", "paths", "left", "checked",
                 "by_path", "looked")

    def __init__(self, sizes: list[int]):
        self.wave = 0  # index of the last opened wave
        self.opened = sizes[0]  # paths [0, opened) may be submitted
        self.next_path = 0  # next path to submit
        self.inflight: set[int] = set()
        self.answers: list[Any] = []  # finished paths' answers, in finishing order
        self.paths: list[int] = []  # the paths those answers came from
        self.left = list(sizes)  # unfinished paths per wave
        self.checked = 0  # the next wave whose stop vote is due
        self.by_path: dict[int, Any] = {}  # finished path -> answer
        self.looked = 0  # check="index": paths 0..looked-1 voted on


class PathPlanner:
    """Which (problem, path) requests to submit or abort, event by event.

    Paths of a problem are numbered in wave order (wave 0 is paths
    0..sizes[0]-1, and so on).  :meth:`admit` fills free capacity: first the
    opened-but-unsent paths of admitted problems, oldest problem first, then
    new problems in order (a wave may go out in parts when few rows are free;
    it still counts as one wave), then, with ``schedule.fill_idle`` and no new
    problem left, the next waves of running problems, one wave per problem
    per pass, oldest first.  :meth:`on_finish` records a finished path; once
    every path of wave w has finished it asks ``stop_check(problem, answers,
    remaining)`` with the answers of waves 0..w in finishing order (a wave
    opened early and finishing first does not bias that vote to its short
    paths), or after every path with ``check="path"``; a stopped problem
    opens no more waves and its running paths are returned to abort.
    ``idle_rows()`` (optional) says how many engine rows sit idle when the
    engine is shared with other runs (a server): idle fill then opens waves
    only for those, not for all of this run's free capacity.  ``run_ahead``
    (optional, a :class:`~consensus_spec.sampling.run_ahead.RunAhead`)
    decides which of those waves pay for their rows: the ones the stop
    rule is likely to need, while that likelihood beats what a row costs.
    """

    def __init__(self, num_problems: int, n: int, schedule: Schedule | None = None,
                 stop_check: StopCheck | None = None,
                 idle_rows: Callable[[], int] | None = None, run_ahead: Any = None):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if num_problems < 0:
            raise ValueError("num_problems must be >= 0")
        self.num_problems, self.n = num_problems, n
        self.schedule = schedule or ALL_AT_ONCE
        self.capacity = self.schedule.capacity
        self.stop_check = stop_check
        self.idle_rows = idle_rows  # None: rows this run's capacity leaves free are idle
        self.run_ahead = run_ahead
        # (p, answers in finishing order, unfinished) -> the full-n vote cannot change (exact:
        # any order will do); asked once paths beyond the voted prefix have finished
        self.decided_check: StopCheck | None = None
        self.sizes = self.schedule.sizes(n)
        self.ends = list(itertools.accumulate(self.sizes))  # one past each wave's last path
        self.problems: dict[int, _Problem] = {}
        self.next_problem = 0
        self.num_inflight = 0
        self.stopped: set[int] = set()
        self._ready: list[int] = []  # heap of admitted problems with unsent opened paths
        self._unopened: dict[int, None] = {}  # admitted, running problems with waves to open
        self._num_done = 0

    # -- events ---------------------------------------------------------------

    def admit(self) -> list[tuple[int, int]]:
        """Paths to submit now to fill the free capacity."""
        out = self._send_ready()
        while self.next_problem < self.num_problems and self._free() > 0:
            p = self.next_problem
            self.next_problem += 1
            st = self.problems[p] = _Problem(self.sizes)
            if len(self.sizes) > 1:
                self._unopened[p] = None
            out += self._send(p, st, self._free())
            if st.next_path < st.opened:
                heapq.heappush(self._ready, p)
        if not (self.schedule.fill_idle and self.capacity is not None
                and self.next_problem == self.num_problems):  # unbounded: no rows idle
            return out
        spare = self._free()  # own capacity; on a shared engine only the rows idle engine-wide
        if self.idle_rows is not None:
            spare = min(spare, self.idle_rows() - len(out))
        if self.run_ahead is not None:
            return out + self._run_ahead(int(spare), len(out)) if spare > 0 else out
        while spare > 0 and self._unopened:
            opened = 0
            for p in list(self._unopened):  # one wave each, oldest first
                if spare <= 0:
                    break
                size = self._open_next(p)
                spare, opened = spare - size, opened + size
            out += self._send_ready()
            if not opened:
                break  # nothing left to open: never spin
        return out

    def on_finish(self, p: int, path: int, answer: Any) -> tuple[list, list]:
        """Record a finished path; return (paths to submit, paths to abort)."""
        st = self.problems.get(p)
        if st is None or path not in st.inflight:
            return [], []  # aborted earlier, or not ours
        st.inflight.discard(path)
        self.num_inflight -= 1
        st.answers.append(answer)
        st.paths.append(path)
        st.by_path[path] = answer
        st.left[bisect.bisect_right(self.ends, path)] -= 1
        finished = len(st.answers)
        if finished == self.n:
            self._num_done += 1
            self._unopened.pop(p, None)
            return self.admit(), []
        if self._vote_says_stop(p, st):
            return self._stop(p, st)
        if st.checked > st.wave or (self.schedule.check == "path" and finished == st.opened):
            self._open_next(p)  # every opened wave finished: the next one is due
        return self.admit(), []

    def stop(self, p: int) -> tuple[list, list]:
        """End problem ``p`` now, as a settled vote does (for a caller's own
        vote, e.g. one on running paths): (paths to submit, its paths to
        abort); nothing if it is not running or already done."""
        st = self.problems.get(p)
        if st is None or p in self.stopped or len(st.answers) == self.n:
            return [], []
        return self._stop(p, st)

    def _stop(self, p: int, st: _Problem) -> tuple[list, list]:
        abort = [(p, k) for k in sorted(st.inflight)]
        self.num_inflight -= len(abort)
        st.inflight.clear()
        st.opened = st.next_path  # nothing more to send
        self.stopped.add(p)
        self._num_done += 1
        self._unopened.pop(p, None)
        return self.admit(), abort

    def _vote_says_stop(self, p: int, st: _Problem) -> bool:
        """Take the votes now due; advances ``st.checked`` past finished waves."""
        check = self.stop_check
        if self.schedule.check == "path":
            return check is not None and check(p, list(st.answers), self.n - len(st.answers))
        if self.schedule.check == "index":
            while st.looked in st.by_path:  # paths 0..looked have all finished
                st.looked += 1
                if check is not None and st.looked < self.n and \
                        check(p, [st.by_path[k] for k in range(st.looked)], self.n - st.looked):
                    return True
            if self.decided_check is not None and len(st.answers) > st.looked and \
                    self.decided_check(p, list(st.answers), self.n - len(st.answers)):
                return True
            check = None  # below: only move past finished waves
        while st.checked <= st.wave and st.left[st.checked] == 0:
            upto = self.ends[st.checked]
            st.checked += 1
            if check is not None and upto < self.n and \
                    check(p, [a for k, a in zip(st.paths, st.answers) if k < upto], self.n - upto):
                return True
        return False

    def _run_ahead(self, spare: int, sending: int) -> list[tuple[int, int]]:
        """Open the waves run-ahead finds worth their rows (see
        :class:`~consensus_spec.sampling.run_ahead.RunAhead`)."""
        ahead: dict[int, int] = {}  # problem -> waves chosen beyond its open ones

        def candidate(p: int):
            st = self.problems[p]
            j = st.wave + 1 + ahead.get(p, 0)
            if j >= len(self.sizes):
                return None
            return self.run_ahead.worth(st.answers, self._looks(st, j), self.n), self.sizes[j]

        def following(p: int):
            ahead[p] = ahead.get(p, 0) + 1
            return candidate(p)

        first = [(c[0], c[1], p) for p in self._unopened if (c := candidate(p)) is not None]
        if not first:
            return []
        costs = self.run_ahead.costs
        engine_rows = costs.rows() if costs is not None else 0
        rows = max(engine_rows, self.num_inflight - sending) + sending
        own = (self.num_inflight, self.next_problem - self._num_done)
        for p in self.run_ahead.choose(first, spare, rows, following, own):
            self._open_next(p)
        return self._send_ready()

    def _looks(self, st: _Problem, j: int) -> list[int]:
        """The looks (paths voted at each) still to come before wave ``j``
        is needed: after each wave from the next due up to ``j - 1``, or
        after every path with ``check="path"``."""
        last = self.ends[j - 1]
        if self.schedule.check == "path":
            return list(range(len(st.answers) + 1, min(last, self.n - 1) + 1))
        if self.schedule.check == "index":
            return list(range(st.looked + 1, min(last, self.n - 1) + 1))
        return [self.ends[c] for c in range(st.checked, j) if self.ends[c] < self.n]

    def _open_next(self, p: int) -> int:
        """Open problem ``p``'s next wave; returns its size (0: none left)."""
        st = self.problems[p]
        if st.wave + 1 >= len(self.sizes):
            return 0
        st.wave += 1
        st.opened += self.sizes[st.wave]
        heapq.heappush(self._ready, p)
        if st.wave + 1 >= len(self.sizes):
            self._unopened.pop(p, None)
        return self.sizes[st.wave]

    def _send_ready(self) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        while self._ready and self._free() > 0:
            p = self._ready[0]
            st = self.problems[p]
            out += self._send(p, st, self._free())
            if st.next_path == st.opened:
                heapq.heappop(self._ready)
        return out

    # -- state ----------------------------------------------------------------

    def done(self, p: int) -> bool:
        """Problem ``p`` has its final vote: all paths finished or stopped."""
        st = self.problems.get(p)
        return st is not None and (p in self.stopped or len(st.answers) == self.n)

    def progress(self, p: int) -> "Progress | None":
        """Problem ``p``'s started paths while it still runs: the finished
        ones with their answers (in path order; paths start in path order,
        so started paths are a prefix), the running ones, and how many are
        not started.  None once it is done, stopped or not admitted, or when
        it has no running path."""
        st = self.problems.get(p)
        if st is None or self.done(p) or not st.inflight:
            return None
        finished = [k for k in range(st.next_path) if k in st.by_path]
        return Progress(finished, [st.by_path[k] for k in finished], sorted(st.inflight),
                        self.n - st.next_path)

    @property
    def all_done(self) -> bool:
        return self._num_done == self.num_problems

    def waves_started(self, p: int) -> int:
        """Waves of problem ``p`` opened so far (the first opens on admission)."""
        st = self.problems.get(p)
        return 0 if st is None else st.wave + 1

    def rows_wanted(self) -> int:
        """Rows idle fill would take now if they were idle: the unopened
        paths of running problems, up to this run's free capacity."""
        want = sum(self.n - self.problems[p].opened for p in self._unopened)
        return int(min(self._free(), want)) if self.schedule.fill_idle else 0

    def num_unsent(self, p: int) -> int:
        """Paths of ``p`` that were never submitted (all of them if not admitted)."""
        st = self.problems.get(p)
        return self.n if st is None else self.n - st.next_path

    def _free(self) -> float:
        return float("inf") if self.capacity is None else self.capacity - self.num_inflight

    def _send(self, p: int, st: _Problem, room: float) -> list[tuple[int, int]]:
        count = int(min(room, st.opened - st.next_path))
        paths = list(range(st.next_path, st.next_path + count))
        st.next_path += count
        st.inflight.update(paths)
        self.num_inflight += count
        return [(p, k) for k in paths]
