"""The waves replay (`python -m evals waves`, evals/adaptive/waves.py): paths enter as the planner releases
them, aborted paths leave with their tokens counted, and the projection sums
each replayed step at its own batch size."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from consensus_spec.sampling.stopping import StopRule
from consensus_spec.sampling.waves import Schedule
from evals.adaptive import waves as waves_replay
from evals.replay.projection import HostTime, StepCosts, run_ms
from evals.traces import Problem
from tests.test_replay import STEP_COSTS, TRACES

EOS = 0


def problems_with_answers(num: int = 6, n: int = 8):
    """Problem p: paths share a long prefix; path answers: class 0 for the
    first 6 paths of even problems (settled early), mixed otherwise."""
    problems, ids = [], []
    for p in range(num):
        prompt = [100 + p, 7, 7]
        comps = [[10, 11, 12, 13, 14, 15] + [20 + (k % 3)] * (3 + k) + [EOS] for k in range(n)]
        problems.append(Problem(f"p{p}", prompt, comps))
        ids.append([0] * n if p % 2 == 0 else [k % 3 for k in range(n)])
    return problems, ids, [None] * num


def args(rows=8, k=4):
    return SimpleNamespace(rows=rows, k=k)


def test_plain_runs_every_path_and_waves_stop_settled_problems():
    problems, ids, correct = problems_with_answers()
    total = sum(len(c) for p in problems for c in p.completions)
    plain = waves_replay.run_one(problems, ids, correct, 8, "none", Schedule(waves=("rest",), capacity=8),
                                 None, args(), {})
    assert plain["tokens"] == total and plain["paths_per_problem"] == 8
    assert plain["aborted_tokens"] == 0 and plain["agreement"] == 1.0 and plain["tau"] == 1.0
    assert sum(plain["_steps"][0]) == total - 6 * 8  # each path's first token comes from prefill

    waves = waves_replay.run_one(problems, ids, correct, 8, "none", Schedule(waves=(2,), capacity=8),
                                 StopRule(), args(), {})
    assert waves["tokens"] < total and waves["paths_per_problem"] < 8
    assert waves["agreement"] == 1.0  # settled problems stop on the full-N answer


def test_idle_fill_aborts_running_paths_and_counts_their_tokens():
    problems, ids, correct = problems_with_answers(num=2)
    fill = waves_replay.run_one(problems, ids, correct, 8, "none", Schedule(waves=(2,), capacity=8),
                                StopRule(kind="decided"), args(), {})
    strict = waves_replay.run_one(problems, ids, correct, 8, "none",
                                  Schedule(waves=(2,), capacity=8, fill_idle=False),
                                  StopRule(kind="decided"), args(), {})
    assert fill["aborted_tokens"] > 0 and strict["aborted_tokens"] == 0
    assert fill["steps"] < strict["steps"]  # rows that sat idle ran later waves early
    finished = sum(len(problems[p].completions[k]) for p in range(2) for k in range(8))
    assert fill["tokens"] <= finished


def test_consensus_drafting_keeps_answers_and_cuts_steps():
    problems, ids, correct = problems_with_answers()
    schedule = Schedule(waves=(2,), capacity=8)
    none = waves_replay.run_one(problems, ids, correct, 8, "none", schedule, StopRule(), args(), {})
    cons = waves_replay.run_one(problems, ids, correct, 8, "consensus", schedule, StopRule(), args(),
                                {"cost_model": "off"})
    assert cons["tau"] > 1.0 and cons["steps"] < none["steps"]
    assert cons["agreement"] == none["agreement"]
    rows, drafted, drafter_ms = cons.pop("_steps")
    assert len(rows) == len(drafted) == len(drafter_ms) and sum(drafted) > 0


def test_run_ms_sums_steps_at_their_own_batch_sizes():
    costs = StepCosts([{"B": b, "q": q, "ms": b + 10 * q} for b in (1, 8) for q in (1, 2)])
    assert costs.step_ms_between(4, 1.0) == pytest.approx(4 + 10)  # linear between B1 and B8
    with pytest.raises(ValueError):
        costs.step_ms_between(9, 1.0)
    # steps of 8 and 1 rows; the second drafts 1 token per row; a last drafter-only call
    assert run_ms(costs, [8, 1, 0], [0, 1, 0]) == pytest.approx(18 + 21)
    assert run_ms(costs, [8, 1, 0], [0, 1, 0], drafter_ms=[1, 1, 1]) == pytest.approx(18 + 21 + 3)
    host = HostTime([{"B": 1, "host_ms": 30.0}, {"B": 8, "host_ms": 30.0}])
    assert run_ms(costs, [8], [0], host=host, hide_host=True) == pytest.approx(30)  # host-bound
    assert run_ms(costs, [8], [0], drafter_ms=[1], host=host) == pytest.approx(18 + 1 + 30)


def test_command_on_recorded_traces(tmp_path):
    """The recorded fixture (tests/fixtures/embedded_n8.jsonl): its token ids are
    replayed and its texts counted without loading a tokenizer."""
    out = tmp_path / "w"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-m", "evals", "waves", "--traces", TRACES, "--limit", "8",
                          "--orders", "1", "--rows", "16", "--costs", STEP_COSTS, "--host-time", "none",
                          "--early-stop", "on", "decided", "--out", str(out)],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    text = run.stdout
    assert "all at once | none" in text and "waves 2, sequential" in text and "waves 2, decided" in text
    assert (tmp_path / "w.json").exists() and (tmp_path / "w.md").exists()
    assert (tmp_path / "w.png").exists()


def test_bad_arguments_exit_with_usage():
    for bad in (["--rows", "0"], ["--waves", "x"], ["--early-stop", "nonsense"], ["--early-stop", "off"]):
        with pytest.raises(SystemExit):
            waves_replay.parse_args(bad)
