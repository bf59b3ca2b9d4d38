"""The waves replay (`python -m evals waves`, evals/adaptive/waves.py): paths enter as the planner releases
them, aborted paths leave with their tokens counted, and the projection sums
each replayed step at its own batch size.  Run as a user runs it, on trace
files the tests write (a path's answer is in its text)."""

from __future__ import annotations

import json

import pytest

from tests.evals_cli import STEP_COSTS, TRACES, ok, read_json, run_evals, write_traces

EOS = 2


def problems_with_answers(num: int = 6, n: int = 8):
    """Problem p: paths share a long prefix; path answers: one class for all
    paths of even problems (settled early), three classes otherwise."""
    problems, texts = [], []
    for p in range(num):
        prompt = [100 + p, 7, 7]
        comps = [[10, 11, 12, 13, 14, 15] + [20 + (k % 3)] * (3 + k) + [EOS] for k in range(n)]
        problems.append((f"p{p}", prompt, comps))
        texts.append([f"The answer is {0 if p % 2 == 0 else k % 3}." for k in range(n)])
    return problems, texts


def waves(tmp, name, traces, *extra):
    ok(run_evals("waves", "--traces", *traces, "--orders", "1", "--rows", "8", "--k", "4", "--waves", "2",
                 "--option", "cost_model=off", "--no-plot", *extra, "--out", tmp / name))
    return {(r["traces"], r["waves"], r["early_stop"], r["method"]): r for r in read_json(tmp / f"{name}.json")["results"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """six (6 problems x 8 paths) and two (its first 2): plain, and waves of 2
    under the default rule and "decided", idle fill on and off."""
    tmp = tmp_path_factory.mktemp("waves")
    problems, texts = problems_with_answers()
    traces = [write_traces(tmp / "six.jsonl", problems, texts), write_traces(tmp / "two.jsonl", problems[:2], texts[:2])]
    return waves(tmp, "w", traces, "--costs", STEP_COSTS, "--host-time", "none", "--early-stop", "on", "decided",
                 "--fill", "both")


def find(runs, traces, method, rule="off", fill=True):
    """The result of ``method`` under ``rule`` (off: the plain run, every path at once)."""
    if rule == "off":
        return runs[(traces, "all", "off", method)]
    (row,) = [r for (t, w, e, m), r in runs.items() if (t, e, m) == (traces, rule, method)
              and w.startswith("2") and ("no-fill" not in w) == fill]
    return row


def test_plain_runs_every_path_and_waves_stop_settled_problems(runs):
    problems, _ = problems_with_answers()
    total = sum(len(c) for _, _, comps in problems for c in comps)
    plain = find(runs, "six", "none")
    assert plain["tokens"] == total and plain["paths_per_problem"] == 8
    assert plain["aborted_tokens"] == 0 and plain["agreement"] == 1.0 and plain["tau"] == 1.0
    assert plain["row_steps"] == total - 6 * 8  # each path's first token comes from prefill

    rule = next(e for (t, w, e, m) in runs if e not in ("off", "decided"))  # the default rule ("on")
    waved = find(runs, "six", "none", rule)
    assert waved["tokens"] < total and waved["paths_per_problem"] < 8
    assert waved["agreement"] == 1.0  # settled problems stop on the full-N answer


def test_idle_fill_aborts_running_paths_and_counts_their_tokens(runs):
    problems, _ = problems_with_answers(num=2)
    fill = find(runs, "two", "none", "decided", fill=True)
    strict = find(runs, "two", "none", "decided", fill=False)
    # both abort a stopped problem's running paths (votes come path by path);
    # idle fill also ran later waves early, on rows that sat idle
    assert fill["aborted_tokens"] > 0 and fill["aborted_tokens"] >= strict["aborted_tokens"]
    assert fill["steps"] < strict["steps"]
    finished = sum(len(c) for _, _, comps in problems for c in comps)
    assert fill["tokens"] <= finished


def test_consensus_drafting_keeps_answers_and_cuts_steps(runs):
    rule = next(e for (t, w, e, m) in runs if e not in ("off", "decided"))
    none = find(runs, "six", "none", rule)
    cons = find(runs, "six", "consensus", rule)
    assert cons["tau"] > 1.0 and cons["steps"] < none["steps"]
    assert cons["agreement"] == none["agreement"]
    assert cons["drafted"] > 0 and none["drafted"] == 0


def test_run_is_projected_step_by_step_at_each_steps_batch_size(tmp_path):
    """Costs linear in B between B1 and B8 (ms = B + 10 q), host time 30 ms."""
    costs = tmp_path / "costs.jsonl"
    costs.write_text("".join(json.dumps({"B": b, "q": q, "ms": b + 10 * q}) + "\n"
                             for b in (1, 8) for q in (1, 2, 3, 4, 5, 6)))
    host = tmp_path / "host.jsonl"
    host.write_text('{"B": 1, "host_ms": 30.0}\n{"B": 8, "host_ms": 30.0}\n')
    problems, texts = problems_with_answers(num=3)
    traces = write_traces(tmp_path / "three.jsonl", problems, texts)
    got = waves(tmp_path, "w", [traces], "--costs", costs, "--host-time", host, "--early-stop", "decided")
    none, cons = find(got, "three", "none"), find(got, "three", "consensus")
    # no drafting: T(B, 1) = B + 10 per step, at that step's B (B is below 8 at the tail)
    assert none["projected_s"] * 1000 == pytest.approx(none["row_steps"] + 10 * none["steps"])
    assert none["row_steps"] < 8 * none["steps"]
    # ... and its host time hides behind the step but bounds it: 30 ms > 18 ms
    assert none["projected_async_s"] * 1000 == pytest.approx(30 * none["steps"])
    # drafting pays the host time serially, every step
    assert (cons["projected_async_s"] - cons["projected_s"]) * 1000 == pytest.approx(30 * cons["steps"])
    # a batch size beyond the table cannot be projected
    out = run_evals("waves", "--traces", traces, "--orders", "1", "--rows", "12", "--k", "4", "--waves", "2",
                    "--costs", costs, "--host-time", "none", "--early-stop", "decided", "--no-plot",
                    "--out", tmp_path / "big")
    assert out.returncode == 2 and "outside the cost table's 1..8" in out.stderr


def test_command_on_recorded_traces(tmp_path):
    """The recorded fixture (tests/fixtures/embedded_n8.jsonl): its token ids are
    replayed and its texts counted without loading a tokenizer."""
    out = tmp_path / "w"
    run = run_evals("waves", "--traces", TRACES, "--limit", "8", "--orders", "1", "--rows", "16",
                    "--costs", STEP_COSTS, "--host-time", "none", "--early-stop", "on", "decided", "--out", out)
    text = ok(run)
    assert "all at once | none" in text and "waves 2, bayes" in text and "waves 2, decided" in text
    assert (tmp_path / "w.json").exists() and (tmp_path / "w.md").exists()
    assert (tmp_path / "w.png").exists()


def test_bad_arguments_exit_with_usage(tmp_path):
    for bad in (["--rows", "0"], ["--waves", "x"], ["--early-stop", "nonsense"], ["--early-stop", "off"]):
        out = run_evals("waves", *bad, "--out", tmp_path / "w")
        assert out.returncode == 2 and "usage: python -m evals waves" in out.stderr, bad
