"""``python -m evals``: one entry point that lists every tool, each command
runs the module of the same name (dashes as underscores), and the layout
stays walkable (no module over 350 lines, no folder over 12 modules).
Checked through the command line and the files, without importing evals."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys

import pytest

from tests.evals_cli import STEP_COSTS, TRACES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVALS = os.path.join(ROOT, "evals")
COMMANDS = ("replay", "dp-replay", "device-report", "faults", "stream", "stop-rules", "waves", "waves-sim", "forecast",
            "confidence",
            "math", "record", "serve-sc", "serve-sc-lm-eval", "rollout", "step-costs", "host-time",
            "propose-time", "warmup", "fetch-model", "check-vllm", "gpu-check", "gpu-step-costs",
            "draft-oracle")


def evals(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "evals", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def listing() -> dict[str, str]:
    """command -> the package folder ``python -m evals`` lists it under."""
    out = evals()
    assert out.returncode == 0, out.stderr
    assert evals("--help").stdout == out.stdout
    folder, found = None, {}
    for line in out.stdout.splitlines()[1:]:
        if line.endswith("/"):
            folder = line[:-1]
        elif not line.lstrip().startswith("-"):  # "--isa ...": a global option, not a command
            found[line.split()[0]] = folder
    return found


def test_every_command_is_listed_and_names_its_module(listing):
    assert sorted(listing) == sorted(COMMANDS)
    for command, folder in listing.items():
        module = os.path.join(ROOT, folder, command.replace("-", "_") + ".py")
        assert os.path.isfile(module), (command, module)
        assert re.search(r"^def main\(argv=None\) -> int:", open(module).read(), re.M), module


def test_help_of_a_command_and_unknown_commands():
    out = evals("math", "--help")
    assert out.returncode == 0 and "--methods" in out.stdout
    out = evals("fetch-model", "--help")
    assert out.returncode == 0 and "python -m evals fetch-model" in out.stdout
    out = evals("stopping")  # renamed stop-rules (consensus_spec.sampling.stopping is the library's)
    assert out.returncode == 2 and "unknown command 'stopping'" in out.stderr and "stop-rules" in out.stdout
    old = subprocess.run([sys.executable, "-m", "evals.replay_bench", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert old.returncode != 0  # module paths moved into sub-packages, no aliases


def test_layout_limits():
    for folder, _dirs, files in os.walk(EVALS):
        modules = [f for f in files if f.endswith(".py")]
        assert len(modules) <= 12, (folder, len(modules))
        for f in modules:
            with open(os.path.join(folder, f)) as fh:
                lines = sum(1 for _ in fh)
            assert lines <= 350, (os.path.join(folder, f), lines)


def test_a_missing_input_file_is_one_line_not_a_traceback(tmp_path):
    missing = str(tmp_path / "no_such_results.json")
    for args in (("device-report", missing), ("device-report", "--host-bench", missing)):
        out = evals(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert "Traceback" not in out.stderr and missing in out.stderr, (args, out.stderr)


def test_a_bad_trace_line_is_an_error_unless_skipped(tmp_path):
    """Every reader of trace files (replay's problems, the vote traces,
    forecast's path texts, confidence's logprobs) keeps one policy: a line
    that is not a JSON object stops the command with the file and the line;
    with --skip-bad-lines it is skipped, counted and reported."""
    lines = []
    with open(TRACES, encoding="utf-8") as f:
        for line in itertools.islice(f, 3):
            obj = json.loads(line)
            obj["logprobs"] = [[-0.1] * len(ids) for ids in obj["completion_ids"]]
            lines.append(json.dumps(obj))
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([lines[0], '{"id": "cut", "completions": ["x', *lines[1:]]) + "\n")
    commands = {
        "replay": ("--methods", "none", "--batches", "8", "--schedules", "fixed", "--online", "off",
                   "--repeats", "1", "--costs", STEP_COSTS, "--host-time", "none", "--out", tmp_path / "r"),
        "stop-rules": ("--perms", "1", "--out", tmp_path / "s.json"),
        "forecast": (),
        "confidence": ("--perms", "1", "--out", tmp_path / "c"),
    }
    for command, args in commands.items():
        out = evals(command, "--traces", str(path), *map(str, args))
        assert out.returncode == 2, (command, out.stderr[-2000:])
        assert f"{path}, line 2: not valid JSON" in out.stderr and "Traceback" not in out.stderr, command
        out = evals(command, "--traces", str(path), *map(str, args), "--skip-bad-lines")
        assert out.returncode == 0, (command, out.stderr[-2000:])
        assert "bad.jsonl: skipped 1 line(s) not a JSON object: 2" in out.stderr, command


def test_serve_sc_merge_joins_runs_split_across_invocations(tmp_path, capsys):
    """Two runs saved by two ``serve-sc --out`` invocations give one table of
    both (means and per-run ranges), with no server started."""
    from consensus_spec.model.synthetic import test_set
    from evals.math import serve_sc

    golds = [p["answer"] for p in test_set(2)]

    def cell(wall, right):
        return {"wall_s": wall, "server_cpu_s": 2.0 * wall, "client_cpu_s": 0.1, "records": [
            {"ok": True, "i": i, "s": 0.5 + i, "answer": str(golds[i]) if right else "-1",
             "tokens": 100, "paths": 16, "mode": "all"} for i in range(2)]}

    files = []
    for run, (fast, slow) in enumerate([(1.0, 2.0), (2.0, 2.0)]):
        files.append(tmp_path / f"r{run}.json")
        files[-1].write_text(json.dumps({"runs": {"None": [{
            "endpoint": {"4": cell(fast, True)}, "client-drafting": {"4": cell(slow, run == 0)}}]}}))
    argv = ["--problems", "2", "--concurrency", "4", "--configs", "endpoint,client-drafting", "--merge"]
    assert serve_sc.main(argv + [str(f) for f in files]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| endpoint |"))
    assert "| 1.500 (1.000-2.000) | 1.50 (1.00-2.00) / - |" in row  # 2 answers in 1 s and in 2 s
    assert "| 1.000 (±0.000) |" in row  # gold: both runs right
    with pytest.raises(SystemExit):  # a concurrency the files never ran
        serve_sc.main(["--problems", "2", "--concurrency", "8", "--merge", str(files[0])])
