"""What consensus_spec assumes of vLLM: ``python -m evals check-vllm`` on the
installed vLLM (every assumption holds), on copies of its files changed the
ways a release changes them (each caught, with file and line), from a
wheel's zip, and the engine-start WARNING on a release not checked.
Nothing here downloads: ``--version`` is run against a wheel already in
the cache folder."""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import zipfile

import numpy as np
import pytest

from consensus_spec.vllm import assumptions, compat
from consensus_spec.vllm.assumptions import ASSUMPTIONS, CHECKED_VERSIONS, warn_if_unchecked
from tests.evals_cli import run_evals
from tests.stand_in import stand_in_config

LINE = re.compile(r"^(holds|changed|missing)\s+(.+?)\s+(\S+\.py(?::\d+)?)(?:\s\s(.*))?$")


def _installed_vllm() -> str:
    import importlib.util

    spec = importlib.util.find_spec("vllm")  # declared (cpu extra): a missing one fails
    return list(spec.submodule_search_locations)[0]


def _lines(stdout: str) -> dict[str, tuple[str, str, str]]:
    """assumption name -> (status, file:line, detail) from check-vllm's output."""
    out = {}
    for line in stdout.splitlines():
        m = LINE.match(line)
        if m:
            out[m.group(2)] = (m.group(1), m.group(3), m.group(4) or "")
    return out


def test_every_assumption_holds_on_the_installed_vllm():
    out = run_evals("check-vllm", "--installed", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = _lines(out.stdout)
    assert sorted(lines) == sorted(a.name for a in ASSUMPTIONS)
    assert all(status == "holds" for status, _, _ in lines.values()), out.stdout
    for a in ASSUMPTIONS:  # each names the file it was found in, with a line
        assert re.fullmatch(re.escape(a.file) + r":\d+", lines[a.name][1]), (a.name, lines[a.name])
    assert f"{len(ASSUMPTIONS)} holds, 0 changed, 0 missing" in out.stdout
    assert "checked against vLLM " + ", ".join(CHECKED_VERSIONS) in out.stdout
    vllm_dir = _installed_vllm()
    assert f"from installed, {vllm_dir}" in out.stdout


def _changed_copy(root) -> str:
    """A vllm/ folder with two of the installed files changed as a release
    might change them, two small made-up ones (one this Python cannot
    parse) and a made-up version; every other file absent."""
    src, dst = _installed_vllm(), os.path.join(root, "vllm")
    for rel in ("v1/spec_decode/custom_class_proposer.py", "v1/sample/rejection_sampler.py"):
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy(os.path.join(src, rel), os.path.join(dst, rel))
    _edit(dst, "v1/spec_decode/custom_class_proposer.py",
          "instance = user_class(vllm_config)", "instance = user_class(vllm_config, None)")
    _edit(dst, "v1/sample/rejection_sampler.py", "def expand_batch_to_tokens(\n",
          "def expand_batch_to_tokens(\n    device,\n")
    os.makedirs(os.path.join(dst, "config"))
    with open(os.path.join(dst, "config", "vllm.py"), "w") as f:  # async rule naming custom_class
        f.write("class VllmConfig:\n"
                "    def __post_init__(self):\n"
                "        if get_args(EagleModelTypes) or get_args(NgramGPUTypes):\n"
                "            pass\n"
                "        if self.speculative_config.method == 'custom_class':\n"
                "            self.scheduler_config.async_scheduling = False\n")
    os.makedirs(os.path.join(dst, "plugins"))
    with open(os.path.join(dst, "plugins", "__init__.py"), "w") as f:  # syntax this Python lacks
        f.write("DEFAULT_PLUGINS_GROUP = 'vllm.general_plugins'\ndef load(group) -> ???:\n    pass\n")
    with open(os.path.join(dst, "_version.py"), "w") as f:
        f.write("__version__ = version = '0.99.0'\n")
    return root


def _edit(root, rel, old, new):
    path = os.path.join(root, rel)
    text = open(path).read()
    assert old in text, (rel, old)
    with open(path, "w") as f:
        f.write(text.replace(old, new, 1))


def _line_of(root, rel, text) -> int:
    with open(os.path.join(root, "vllm", rel)) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def _check_changed(out, root):
    assert out.returncode == 1, out.stdout + out.stderr
    assert "vLLM 0.99.0 from" in out.stdout and "NOT in that list" in out.stdout
    lines = _lines(out.stdout)
    assert sorted(lines) == sorted(a.name for a in ASSUMPTIONS)
    status, where, detail = lines["custom_class loader"]
    call = _line_of(root, "v1/spec_decode/custom_class_proposer.py", "user_class(vllm_config, None)")
    assert status == "changed" and where == f"v1/spec_decode/custom_class_proposer.py:{call}"
    assert "user_class(vllm_config)" in detail and "user_class(vllm_config, None)" in detail
    status, where, detail = lines["compat: expand_batch_to_tokens"]
    defined = _line_of(root, "v1/sample/rejection_sampler.py", "def expand_batch_to_tokens(")
    assert status == "changed" and where == f"v1/sample/rejection_sampler.py:{defined}"
    assert "(device, x, cu_num_tokens" in detail and "calls written for it no longer fit" in detail
    status, where, detail = lines["async scheduling off for custom_class"]
    assert status == "changed" and where == "config/vllm.py:5" and "'custom_class'" in detail
    status, where, detail = lines["general plugin group"]
    assert (status, where) == ("changed", "plugins/__init__.py:2") and "cannot parse" in detail
    assert lines["rejection_sample"][0] == "holds"  # the same file, unchanged there
    assert lines["runner calls propose"][:2] == ("missing", "v1/worker/gpu_model_runner.py")
    assert lines["V1 runner fallback"][0] == "missing"  # file there, name gone
    assert lines["V1 runner fallback"][2] == "no VllmConfig.use_v2_model_runner"


def test_a_changed_release_is_reported_line_by_line(tmp_path):
    root = _changed_copy(tmp_path)
    _check_changed(run_evals("check-vllm", "--source", root, timeout=120), root)


def test_a_wheel_is_read_from_its_zip_and_version_uses_the_cache(tmp_path):
    root = _changed_copy(tmp_path / "tree")
    cache = tmp_path / "cache"
    cache.mkdir()
    wheel = cache / "vllm-0.99.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for folder, _, files in os.walk(os.path.join(root, "vllm")):
            for name in files:
                path = os.path.join(folder, name)
                z.write(path, os.path.relpath(path, root))
    _check_changed(run_evals("check-vllm", "--source", wheel, timeout=120), root)
    out = run_evals("check-vllm", "--version", "0.99.0", "--cache", cache, timeout=120)
    assert "pip download" not in out.stdout  # found in the cache: nothing fetched
    _check_changed(out, root)


def test_a_source_that_is_not_there_is_a_clear_error(tmp_path):
    out = run_evals("check-vllm", "--source", tmp_path / "nothing", timeout=60)
    assert out.returncode == 2 and "no such file or folder" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.fixture
def warnings_seen(monkeypatch):
    monkeypatch.setattr(assumptions, "_warned", [])
    seen = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    assumptions.logger.addHandler(handler)  # vLLM's logger tree does not propagate to root
    yield seen
    assumptions.logger.removeHandler(handler)


def test_one_warning_on_a_release_not_checked_never_a_refusal(warnings_seen):
    assert not warn_if_unchecked("0.32.0") and not warn_if_unchecked("0.33.0+cu129")
    assert warnings_seen == []
    assert warn_if_unchecked("0.34.0")
    assert not warn_if_unchecked("0.34.0") and not warn_if_unchecked("0.35.1")  # once per process
    assert len(warnings_seen) == 1
    message = warnings_seen[0]
    assert "this is vLLM 0.34.0" in message and ", ".join(CHECKED_VERSIONS) in message
    assert "python -m evals check-vllm" in message and f"{len(ASSUMPTIONS)} assumptions" in message


def test_the_proposer_warns_at_engine_start_and_still_builds(warnings_seen, monkeypatch):
    import vllm  # declared (cpu extra)
    from consensus_spec import ConsensusProposer

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    p = ConsensusProposer(stand_in_config(k=4, max_model_len=200, max_num_seqs=8),
                          cost_model="off", warmup=False)
    tokens = np.zeros((1, 200), np.int32)
    tokens[0, :3] = [5, 6, 1]
    drafts = p.propose([[1]], np.array([3], np.int32), tokens)
    assert len(drafts) == 1 and isinstance(drafts[0], list) and p.num_failures == 0  # it runs
    assert len(warnings_seen) == 1 and "this is vLLM 0.34.0" in warnings_seen[0]
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    monkeypatch.setattr(assumptions, "_warned", [])
    ConsensusProposer(stand_in_config(k=4, max_model_len=200, max_num_seqs=8),
                      cost_model="off", warmup=False)
    assert len(warnings_seen) == 1  # a checked release: nothing said


def test_no_vllm_imported_no_warning(warnings_seen, monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm", raising=False)  # offline tools build the proposer too
    assert not warn_if_unchecked()
    assert warnings_seen == []


def test_compat_fixes_stay_off_on_a_release_not_checked(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    monkeypatch.setattr(compat, "_applied", set())
    called = []
    monkeypatch.setattr(compat, "FIXES", (compat.Fix(
        "x", "x", lambda: called.append("probe") or True, lambda: called.append("apply")),))
    assert not compat.applies_here()  # the version gate, whatever the platform
    assert compat.register() == [] and called == []
