"""vLLM custom proposer (``method: "custom_class"``): a thin adapter.

vLLM builds it with its ``VllmConfig`` and calls ``propose`` once per step with
the batch's sampled tokens and token buffer. Only ``speculative_config``,
``model_config.max_model_len``, ``additional_config`` and (if present)
``scheduler_config.max_num_seqs`` and ``device_config`` are read, so offline
tools can build it from a light stand-in.

The draft budget learns what steps cost on this machine (``online_costs``,
on by default): the proposer times each engine step, from the end of one
``propose`` call to the start of the next, and its own drafting, reading
time only through its attribute ``clock`` (looked up at each call, so a
harness can replace it). A step is charged to its rows and the draft
tokens it verified only when every row continued from the step before
(no prefill, no new, resumed or rejected rows, no missed steps).

It runs inside someone else's engine, so it never lets an exception out of
``propose``: a failing step is logged, the drafting state is rebuilt, and
that step drafts nothing. After ``max_failures`` failing steps in a row
drafting is switched off for the engine's life. Outputs stay the model's
either way: vLLM verifies every draft.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ..budget import AUTO, DraftBudget, cost_model
from ..budget.online import PRIOR_CACHE
from ..budget.policy import STEP_CACHE
from ..drafting.drafter import ConsensusDrafter
from ..drafting.forest import TOKEN_LIMIT
from . import compat
from .assumptions import warn_if_unchecked
from .memory import SAVE_EVERY_STEPS, CostMemory
from .options import options_from_vllm, parse_options
from . import row_kernels
from .rows import RowTracker

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler and format


def plain(value):
    """``value`` with numpy scalars and arrays turned into Python numbers and
    lists, through dicts, lists and tuples."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    return value


LOG_EVERY_S = 300.0  # clock seconds between INFO lines on what the budget learned
# a gap between calls this many times the usual one (and over IDLE_MIN_S) is
# the engine idle between requests, not a step: the guard must not weigh it
IDLE_GAP = 20.0
IDLE_MIN_S = 0.05
IDLE_FIRST_S = 1.0  # before any usual gap is known
# steps drafting is off by the guard's policy before the drafter rests: a rest
# ends in a rebuild of the tries, so a batch going back and forth between sizes
# where drafting is off and on rebuilds them at most once in this many steps...
REST_AFTER = 64
REST_PAYBACK = 4.0  # ...and only once the drafter's time saved by then is this many rebuilds


class ConsensusProposer:

    def __init__(self, vllm_config, **options):
        warn_if_unchecked()  # a vLLM release this package was not checked against: one WARNING
        spec = vllm_config.speculative_config
        self.num_speculative_tokens = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        sched = getattr(vllm_config, "scheduler_config", None)
        self._max_num_seqs = int(getattr(sched, "max_num_seqs", 0) or 256)
        merged = {**options_from_vllm(vllm_config), **options}
        self.drafter_options, self.proposer_options = parse_options(merged)
        name = self.proposer_options.cost_model
        self._memory = self._remembered = None
        if name == AUTO:
            device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cuda")
            name = "cpu_embedded" if device == "cpu" else "h200_7b"
            opts = self.proposer_options
            if opts.remember_costs and opts.online_costs:
                self._memory = CostMemory.for_engine(vllm_config, opts.step_costs_dir, self)
                self._remembered = self._memory.load() if self._memory is not None else None
        # a remembered table brings its own prior (the model its fit was relative to)
        self._cost_model = self._remembered["prior"] if self._remembered else cost_model(name)
        self._cost_model_name = name + (" (remembered)" if self._remembered else "")
        self.clock = time.perf_counter  # seconds; replaceable (replay drives virtual time)
        self.steps_timed = 0        # engine steps charged to the budget's cost fit
        self.steps_unattributed = 0  # steps left out (prefill, new rows, missed steps...)
        self.steps_idle = 0  # of those, gaps where the engine sat idle (the guard skips them)
        self._usual_gap = None  # moving average of the time between calls, idle gaps held down
        self._last_rows = 0
        self.num_drafted = 0   # draft tokens proposed
        self.num_accepted = 0  # of those, accepted by the verifier
        self.num_failures = 0  # steps that raised (and drafted nothing)
        self.num_resets = 0    # times the drafting state was rebuilt after a failure
        self.num_regroups = 0  # of those, tries rebuilt with paths kept in their groups
        self.regroup_ms_max = 0.0  # the longest such rebuild (it re-appends rows' outputs)
        self.steps_drafter_off = 0  # steps the guard kept plain with the drafter not run at all
        self.drafter_catch_ups = 0   # tries rebuilt when drafting came back after such steps
        self.catch_up_ms_max = 0.0
        self._tracked = False  # this call's row tracking finished
        self.disabled = False  # switched off after max_failures failing steps in a row
        self._failing = 0      # failing steps in a row
        self._logged: set[str] = set()  # exception types already logged with a traceback
        self._flat = self._offsets = np.zeros(0, np.int64)  # the drafts packed for vLLM's lists
        self._room = np.zeros(0, np.int64)  # draft tokens each row may get (_propose)
        self._reset()
        self.warmup_s = self._warm_up() if self.proposer_options.warmup else 0.0
        if self.proposer_options.commit_arena:  # after the warm-up's last reset: this arena stays
            self.drafter.forest.commit()
        logger.info("consensus_spec proposer: k=%d, cost model %s%s, %s (warm-up %.2f s, trie "
                    "arena %d MB%s)", self.num_speculative_tokens, name,
                    " (prior; step costs learned online)" if self.budget is not None
                    and self.budget.costs is not None else "", self.drafter_options, self.warmup_s,
                    self.drafter.arena_bytes >> 20,
                    (", committed" + (" in huge pages" if self.drafter.forest.huge_pages else "")
                     if self.proposer_options.commit_arena else ""))

    def _reset(self) -> None:
        """Fresh drafting state (trie forest, row tracking, calibration); step
        costs learned so far are kept (they describe the machine, not the state)."""
        learned = getattr(getattr(self, "budget", None), "costs", None)
        self.drafter = ConsensusDrafter(self.drafter_options)
        table = self._remembered or {}
        self.budget = (DraftBudget(self._cost_model, online=self.proposer_options.online_costs,
                                   measured=table.get("rows"),
                                   drafting_off_at=tuple(table.get("drafting_off_at_rows", ())))
                       if self._cost_model is not None else None)
        if learned is not None and self.budget is not None:
            self.budget.costs = learned
        if self._memory is not None:
            self._memory.budget = self.budget  # what it saves, even once this proposer is gone
        self.rows = RowTracker(self.drafter,
                               max_parked=64 + 4 * self._max_num_seqs, token_limit=TOKEN_LIMIT)
        self._sent = None  # (rows, paths, estimates, lengths) of the drafts last sent
        self._last_end = None  # clock at the end of the last propose call
        self._last_call_s = 0.0  # that call's own time
        self._last_guard_s = 0.0  # of it, what the guard charges (_propose)
        self._stale = False  # the tries missed steps the drafter skipped: rebuild before drafting
        self._off_run = 0  # steps in a row the guard's policy kept plain (REST_AFTER)
        self._drafter_s = 0.0  # the drafter's usual call time (when it runs)
        self._catch_up_s = 0.0  # the last rebuild after a rest
        self._next_log = None

    def _warm_up(self) -> float:
        """Run every compiled kernel once on a made-up batch (vLLM's dtypes),
        the step-cost fit included, so the first request pays no
        compilation; then start afresh (what the made-up steps taught is
        dropped with them)."""
        t0 = time.perf_counter()
        tokens = np.zeros((2, 64), np.int32)
        lengths = np.array([8, 8], np.int32)
        tokens[:, :8] = np.arange(8)
        fake = [0.0]
        try:
            for step in range(6):
                sampled = [[20 + step % 2], [20 + step % 2]]
                tokens[:, lengths[0]] = 20 + step % 2
                lengths += 1
                self._propose(sampled, lengths, tokens, start=fake[0])
                self._last_end = fake[0] + 1e-4
                self._last_call_s = self._last_guard_s = 1e-4
                fake[0] += 0.01
            if self.budget is not None and self.budget.costs is not None:
                self.budget.costs.uncertainty(2)  # exploration's kernel
        except Exception:  # noqa: BLE001 - the first real step will tell
            logger.warning("consensus_spec: warm-up failed; kernels compile on first use",
                           exc_info=True)
        self.budget = None  # nothing learned from made-up steps survives
        self.steps_timed = self.steps_unattributed = self.steps_idle = 0
        self._usual_gap = None
        self.num_drafted = self.num_accepted = 0  # nor counted
        self._reset()
        return time.perf_counter() - t0

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        """One draft list per row (possibly empty). Never raises."""
        if not self.disabled:
            try:
                start = self.clock()
                self._tracked = False
                self._guard_s, self._uncharged_s = None, 0.0
                drafts = self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, start)
                self._failing = 0
                self._last_end = end = self.clock()
                self._last_call_s = end - start
                self._last_guard_s = (self._last_call_s - self._uncharged_s if self._guard_s is None
                                      else self._guard_s)
                if not self._stale:  # the drafter ran (a rest leaves the tries stale)
                    self._drafter_s += 0.1 * (self._last_call_s - self._uncharged_s - self._drafter_s)
                return drafts
            except Exception as error:  # noqa: BLE001 - never take the engine down
                self._last_end = None
                self._contain(error, token_ids_cpu)
        try:
            return [[] for _ in range(len(sampled_token_ids))]
        except Exception:  # noqa: BLE001 - not even a length: vLLM is broken already
            return []

    def _contain(self, error: Exception, token_ids_cpu) -> None:
        """Log a failed step and recover: a first failure after row tracking
        finished keeps the tracker and regroups every row in flight with its
        siblings in fresh tries (:meth:`_regroup`); a second in a row, or one
        in the tracker itself, rebuilds everything; ``max_failures`` in a row
        switch drafting off."""
        self.num_failures += 1
        self._failing += 1
        kind = type(error).__name__
        first = kind not in self._logged
        self._logged.add(kind)
        logger.warning("consensus_spec: drafting step failed (%s: %s); no drafts this step, "
                       "drafting state reset (failure %d, %d in a row)", kind, error,
                       self.num_failures, self._failing, exc_info=first)
        if self._failing >= self.proposer_options.max_failures:
            self.disabled = True
            logger.error("consensus_spec: %d drafting steps failed in a row; drafting is off "
                         "for this engine's life (outputs are unaffected)", self._failing)
            return
        self.num_resets += 1
        if self._failing == 1 and self._tracked:
            try:
                t0 = time.perf_counter()
                rows = self._regroup(token_ids_cpu)
                ms = 1e3 * (time.perf_counter() - t0)
                self.num_regroups += 1
                self.regroup_ms_max = max(self.regroup_ms_max, ms)
                logger.info("consensus_spec: tries rebuilt; %d rows in flight keep their paths and "
                            "groups (%.1f ms)", rows, ms)
                return
            except Exception:  # noqa: BLE001 - fall back to rebuilding everything
                logger.warning("consensus_spec: regrouping after the failure failed; "
                               "rebuilding all drafting state", exc_info=True)
        try:
            self._reset()
        except Exception:  # noqa: BLE001 - cannot even rebuild: stop drafting
            self.disabled = True
            logger.error("consensus_spec: drafting state could not be rebuilt; drafting is off",
                         exc_info=True)

    def _regroup(self, token_ids_cpu) -> int:
        """Fresh tries for every path, the same paths in the same groups: each
        row in flight gets its recent output (the row tracker says which
        path and how far) re-appended from vLLM's token buffer."""
        self._sent = None
        self._stale = False
        self.drafter.drop_tries()
        rows, paths, ends = self.rows.holding()
        if len(rows):
            self.drafter.restore(paths, np.asarray(token_ids_cpu), rows, ends)
        return len(rows)

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                 start: float | None = None) -> list[list[int]]:
        num_rows = len(sampled_token_ids)
        rows = self.rows
        before = rows.events
        step = rows.update(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        self._tracked = True  # a failure from here on leaves the row tracker consistent
        if not len(step.rows):
            self._sent = None
            return [[] for _ in range(num_rows)]
        verified = self._observe()
        clean = verified is not None and len(step.rows) == num_rows and rows.events == before
        self._time_step(num_rows, verified if clean else None, start)
        self._last_rows = num_rows
        m = len(step.ends)
        if len(self._room) < m:
            self._room = np.zeros(2 * m, np.int64)
        room = self._room[:m]  # min(max_model_len - 1 - ends, k) (< 0: none), no numpy temporaries
        row_kernels.room(step.ends, self.max_model_len - 1, self.num_speculative_tokens, room)
        floor = self.budget.floor(num_rows) if self.budget is not None else None
        if self.budget is not None and self.budget.plain_step:
            # the guard weighs a plain step as a plain engine's: no host time of ours (no
            # clock read for it either: a replay's deterministic clock counts its reads)
            self._guard_s = 0.0
            run = self._off_run = self._off_run + 1 if self.budget.drafter_off else 0
            # drafting does not pay for its drafter here: the drafter rests, once that
            # has lasted long enough to pay for the rebuild that ends a rest
            if (self._stale and run) or (run > REST_AFTER and run * self._drafter_s
                                         >= REST_PAYBACK * self._catch_up_s):
                if not self._stale:  # INFO the first time; each later rest (after a window) DEBUG
                    logger.log(logging.DEBUG if self.drafter_catch_ups else logging.INFO,
                               "consensus_spec: drafting off at %d rows for %d steps (it did not "
                               "pay for the drafter's time); the drafter rests until a check says "
                               "otherwise (counters: steps_drafter_off)", num_rows, run)
                self._stale = True
                self._sent = None
                self.steps_drafter_off += 1
                return [[] for _ in range(num_rows)]
        else:
            self._off_run = 0
        if self._stale:
            tokens, probs, lengths = self._catch_up(token_ids_cpu, step.paths, room, floor)
        else:
            # every row's new tokens go in before any row drafts, so each path
            # drafts from its siblings' tokens of this very step
            tokens, probs, lengths = self.drafter.extend_and_draft(
                step.paths, token_ids_cpu, step.rows, step.begins, step.ends, room, floor)
        if self.budget is not None:
            lengths = self.budget(probs, lengths, num_rows)
            if self.budget.redraft:  # its raised floor cut walks the choice needed
                tokens, probs, lengths = self.drafter.draft(step.paths, room, self.budget.safe_floor)
                lengths = self.budget(probs, lengths, num_rows)
        else:
            lengths = lengths.astype(np.int64)  # the drafter's buffer is reused next step
        self._sent = (step.rows, step.paths, probs, lengths)
        return self._lists(step.rows, tokens, lengths, num_rows)

    def _catch_up(self, token_ids_cpu, paths, room, floor):
        """Drafts after steps the drafter skipped: fresh tries with every row in
        flight re-appended (:meth:`_regroup`; finished paths' outputs are not
        back), then this step's walks. The rebuild is left out of what the
        guard charges: it comes once per return, not per step."""
        t0 = self.clock()  # the clock the call is timed by (a replay's is virtual)
        held = self._regroup(token_ids_cpu)
        self._uncharged_s = self._catch_up_s = self.clock() - t0  # _regroup: no longer stale
        self.drafter_catch_ups += 1
        self.catch_up_ms_max = max(self.catch_up_ms_max, 1e3 * self._uncharged_s)
        logger.debug("consensus_spec: drafting back on; %d rows re-appended in %.1f ms", held,
                     1e3 * self._uncharged_s)
        return self.drafter.draft(paths, room, floor)

    def _lists(self, rows, tokens, lengths, num_rows: int) -> list[list[int]]:
        """One list per batch row (vLLM's drafts): ``rows[j]``'s is
        ``tokens[j, :lengths[j]]``, every other row's empty."""
        if len(self._offsets) <= num_rows or len(self._flat) < tokens.size:
            self._offsets = np.zeros(2 * num_rows + 1, np.int64)
            self._flat = np.zeros(2 * tokens.size, np.int64)
        n = row_kernels.pack(rows, tokens, lengths, num_rows, self._flat, self._offsets)
        self.num_drafted += n
        flat, at = self._flat[:n].tolist(), self._offsets[:num_rows + 1].tolist()
        return [flat[a:b] for a, b in zip(at, at[1:])]

    def _observe(self) -> int | None:
        """Count what the verifier kept of last step's drafts; calibrate on
        it. Returns the draft tokens the step verified (None: no last step)."""
        if self._sent is None:
            return None
        rows, paths, probs, sent = self._sent
        accepted, kept, verified = self.rows.accepted(rows, paths, sent)  # zeroes sent where not judged
        self.num_accepted += kept
        if self.budget is not None:
            self.budget.observe(probs, sent, accepted)
        return verified

    def _time_step(self, num_rows: int, verified: int | None, start: float | None) -> None:
        """Charge the engine step that just ran (``verified`` None: not
        attributable) to the budget's cost fit; log what it learned now and then."""
        budget = self.budget
        if budget is None or budget.costs is None or start is None:
            return
        last_end = self._last_end
        if last_end is not None and not self._idle(start - last_end):
            # every step, clean or not, for the guard
            budget.observe_throughput(int(self.rows.step_tokens),
                                      start - last_end + self._last_guard_s)
        if verified is None or last_end is None:
            self.steps_unattributed += 1
        else:
            budget.observe_step(num_rows, verified, 1000.0 * (start - last_end),
                                1000.0 * self._last_call_s)
            self.steps_timed += 1
            if self._memory is not None and self.steps_timed % SAVE_EVERY_STEPS == 0:
                self._memory.maybe_save()
        if self._next_log is None:
            self._next_log = start + LOG_EVERY_S
        elif start >= self._next_log:
            self._next_log = start + LOG_EVERY_S
            learned = self.budget.costs.summary(num_rows)
            logger.info("consensus_spec step costs at %d rows: %s ms per step with 0/1/2 draft "
                        "tokens per row (prior %s, drafter %.2f ms); %d steps timed, %.1f%% "
                        "exploring", num_rows, learned["ms_per_step"], learned["prior_ms_per_step"],
                        learned["drafter_ms"], self.steps_timed, self._explore_pct())

    def _idle(self, gap: float) -> bool:
        """Whether ``gap`` (seconds from the last call's end) held idle time:
        vLLM stops calling propose when no request runs, so the first step
        of the next request comes after the idle time.  The usual gap moves
        towards a long one too (held to the limit), so a lasting change in
        step time (a larger batch) is usual again within a few steps."""
        usual = self._usual_gap
        limit = max(IDLE_MIN_S, IDLE_GAP * usual) if usual is not None else IDLE_FIRST_S
        self._usual_gap = min(gap, limit) if usual is None else 0.9 * usual + 0.1 * min(gap, limit)
        if gap > limit:
            self.steps_idle += 1
            return True
        return False

    def _explore_pct(self) -> float:
        costs = self.budget.costs if self.budget is not None else None
        return 100.0 * costs.steps_explored / max(costs.decisions, 1) if costs is not None else 0.0

    def counters(self) -> dict:
        """The proposer's counters (cumulative over the engine's life), in
        plain Python types: they leave the engine through ``collective_rpc``,
        whose msgpack encoder raises on a numpy scalar, and it raises in the
        engine's output thread, which then dies and every request hangs."""
        return plain(self._counters())

    def _counters(self) -> dict:
        rows = self.rows
        return {
            "num_drafted": self.num_drafted, "num_accepted": self.num_accepted,
            "num_failures": self.num_failures, "num_resets": self.num_resets,
            "num_regroups": self.num_regroups, "regroup_ms_max": round(self.regroup_ms_max, 2),
            "steps_drafter_off": self.steps_drafter_off, "drafter_catch_ups": self.drafter_catch_ups,
            "catch_up_ms_max": round(self.catch_up_ms_max, 2),
            "disabled": self.disabled, "paths_started": rows.paths_started,
            "paths_resumed": rows.paths_resumed, "paths_moved": rows.paths_moved,
            "tokens_missed": rows.tokens_missed, "rows_rejected": rows.rows_rejected,
            "num_groups": self.drafter.num_groups, "trie_nodes": self.drafter.num_nodes(),
            # memory: every structure has a bound (consensus_spec/drafting/drafter.py,
            # consensus_spec/vllm/rows.py); these show where it stands
            "arena_bytes": self.drafter.arena_bytes, "live_groups": self.drafter.num_live_groups,
            "live_paths": self.drafter.num_paths, "path_slots": self.drafter.path_slots,
            "parked_paths": rows.num_parked, "paths_released": rows.paths_released,
            "evictions": self.drafter.evictions, "group_tokens": self.drafter.group_tokens,
            "parked_keys": rows.num_parked_keys,
            "cost_cache_entries": self.budget.cached_batches if self.budget is not None else 0,
            "bounds": self.bounds(),
            # which of vLLM's functions this package patched in this process
            "vllm_patches": compat.active(),
            **self._cost_counters(),
        }

    def bounds(self) -> dict:
        """What each counter of :meth:`counters` stays within for the engine's
        life, however many requests pass (where each bound is set: the
        docstrings of :mod:`consensus_spec.drafting.drafter` and
        :mod:`.rows`); the arena's bytes are fixed at start."""
        o = self.drafter_options
        paths = self._max_num_seqs + self.rows.max_parked  # rows in the batch, plus the parked
        return {"trie_nodes": o.max_trie_nodes,
                # the LRU keeps max_group_tokens, or one group alone (its prompt and tail)
                "group_tokens": max(o.max_group_tokens, self.max_model_len + o.prompt_tokens),
                "parked_paths": self.rows.max_parked, "live_paths": paths, "live_groups": paths,
                "path_slots": max(64, 1 << max(0, paths - 1).bit_length()),
                "arena_bytes": self.drafter.arena_bytes,
                "cost_cache_entries": PRIOR_CACHE + STEP_CACHE}

    def _cost_counters(self) -> dict:
        costs = self.budget.costs if self.budget is not None else None
        if costs is None:
            return {"cost_model": self._cost_model_name, "online_costs": False}
        return {"cost_model": self._cost_model_name, "online_costs": True,
                "steps_timed": self.steps_timed, "steps_unattributed": self.steps_unattributed,
                "steps_idle": self.steps_idle,
                "steps_outliers": costs.steps_rejected, "explore_pct": round(self._explore_pct(), 2),
                "step_costs": costs.summary(self._last_rows),
                "step_costs_by_rows": costs.learned(),
                "guard": self.budget.guard.summary(),
                "learning_cost": self.budget.learning_cost(),
                # steps whose walks stopped at a raised floor, and of those walked again
                "floor_raised_steps": self.budget.steps_raised, "walked_again": self.budget.redrafts,
                "step_costs_file": self._memory.path if self._memory is not None else None}

    def save_step_costs(self) -> str | None:
        """Remember what was learned now (also done every few hundred timed
        steps and when this proposer goes); the file's path, or None."""
        return self._memory.save() if self._memory is not None else None

    def load_model(self, *args, **kwargs) -> None:
        pass  # model-free
