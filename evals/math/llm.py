"""The vLLM engine the math eval and the trace recorder run: which model,
which speculative config, built and shut down; the proposer's counters read
from the engine's worker."""

from __future__ import annotations

import argparse
import os
import re

from ..options import UsageError, parse_options


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """What ``math`` and ``record`` share: the problems, the model, how each
    path is sampled, and the engine's settings (:func:`build_llm` reads them)."""
    ap.add_argument("--limit", type=int, help="first N problems")
    ap.add_argument("--model", help="model directory or hub id (default: the embedded model)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int,
                    help="tokens per sample (default 256 for synthetic, else 1024)")
    add_engine_args(ap)


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The engine settings :func:`build_llm` reads, and ``--verbose``
    (:func:`engine_env`); ``rollout`` shares them."""
    ap.add_argument("--seed", type=int, default=0, help="engine seed")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25,
                    help="vLLM memory share (on CPU it sizes the KV cache in RAM)")
    ap.add_argument("--dtype", default="auto", help="model dtype (float32 is safest on CPU)")
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--max-num-seqs", type=int, help="engine batch rows (default: vLLM's)")
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                    help="eager mode (default: on CPU only; on GPU keep CUDA graphs, which the "
                         "budget's H200 cost model was fitted to)")
    ap.add_argument("--verbose", action="store_true", help="keep vLLM's INFO logs")


def check_run_args(args, positive: tuple[str, ...]) -> None:
    """The checks of :func:`add_run_args`' settings, ``--n`` and ``positive``
    (options that must be >= 1 where given) that need no engine."""
    for name in ("n", *positive, "max_tokens", "max_num_seqs"):
        value = getattr(args, name)
        if any(v is not None and v < 1 for v in (value if isinstance(value, list) else [value])):
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.temperature < 0:
        raise UsageError("--temperature must be >= 0")
    if not 0 < args.top_p <= 1:
        raise UsageError("--top-p must be in (0, 1]")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UsageError("--gpu-memory-utilization must be in (0, 1]")
    if args.max_model_len is not None and args.max_model_len < 16:
        raise UsageError("--max-model-len must be >= 16")


def drafter_options(args, check: bool) -> dict:
    """``--option`` pairs as consensus drafter options; with ``check``, tried
    on :func:`consensus_spec.engine_args` so a bad one fails before an engine."""
    try:
        options = parse_options(args.option)
    except ValueError as e:
        raise UsageError(str(e))
    if check:
        from consensus_spec import engine_args
        try:
            engine_args(args.k, **options)
        except (TypeError, ValueError) as e:
            raise UsageError(f"bad --option: {e}")
    return options


def resolve_model(model: str | None) -> str:
    if model is None:
        from consensus_spec.model import model_path
        try:
            return model_path()
        except FileNotFoundError as e:
            raise UsageError(f"{e}; train it (python -m consensus_spec.model.train) or pass --model DIR")
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise UsageError(f"model directory {model} has no config.json")
        return path
    if os.path.exists(path):
        raise UsageError(f"--model must be a model directory, not a file: {model}")
    first = model.split("/")[0]
    hub_like = (re.fullmatch(r"[\w.-]+/[\w.-]+", model) is not None
                and not model.startswith((".", "~")) and not os.path.isdir(first))
    if hub_like:
        return model  # a Hugging Face hub id; vLLM downloads it (needs internet)
    raise UsageError(f"model directory not found: {model}")


def load_run(args) -> list:
    """The problems of ``--dataset`` (``--limit``), with ``args.model``
    resolved in between (a dataset name or file is checked first, cheaply)."""
    from .datasets import DatasetError, load_problems, resolve
    try:
        resolve(args.dataset)
        args.model = resolve_model(args.model)
        return load_problems(args.dataset, args.limit)
    except DatasetError as e:
        raise UsageError(str(e))


def engine_env(verbose: bool) -> bool:
    """vLLM's logs at WARNING (unless ``verbose``), and on a CPU the engine in
    this process: on a few cores a separate engine process mostly competes
    for them.  True where this call put it in this process."""
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    in_process = on_cpu() and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return in_process


def engine_config(method: str, args) -> dict:
    """vLLM's ``speculative_config`` and ``additional_config`` (where
    consensus's options travel) for ``method``; ngram and suffix draft
    ``--k`` tokens, or ``--ngram-k`` / ``--suffix-k`` where a command has them
    (``rollout``; a suffix k of None leaves vLLM's)."""
    if method == "consensus":
        from consensus_spec import engine_args
        return engine_args(args.k, **args.drafter_options)
    config = None
    if method != "none":
        k = getattr(args, f"{method}_k", args.k)
        config = {"method": method, **({"num_speculative_tokens": k} if k else {})}
        if method == "ngram" and args.ngram_lookup:
            config["prompt_lookup_min"], config["prompt_lookup_max"] = args.ngram_lookup
    return {"speculative_config": config, "additional_config": {}}


def check_dependencies(methods: list[str]) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise UsageError("vLLM is not installed (pip install -e .[cpu] or .[gpu])")
    if "suffix" in methods:
        try:
            import arctic_inference  # noqa: F401
        except ImportError:
            raise UsageError("method suffix needs arctic-inference (pip install arctic-inference) "
                             "or drop it from --methods")


def on_cpu() -> bool:
    """vLLM will run on the CPU backend (no GPU visible to torch)."""
    import torch

    return not torch.cuda.is_available()


def build_llm(method: str, args, log_stats: bool = True):
    """The engine for ``method`` with :func:`add_engine_args`' settings;
    ``log_stats`` keeps vLLM's stats (the spec-decode counters read them)."""
    from vllm import LLM

    kwargs = dict(model=args.model, **engine_config(method, args), seed=args.seed,
                  dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                  enforce_eager=on_cpu() if args.enforce_eager is None else args.enforce_eager,
                  disable_log_stats=not log_stats)
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
    return LLM(**kwargs)


def shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the engine may be gone already
        pass


def drafter_counters(worker) -> dict | None:
    """Run in the engine's worker (``LLM.collective_rpc``): the consensus
    proposer's counters, what its budget learned included."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    counters = getattr(drafter, "counters", None)
    return counters() if counters is not None else None


def proposer_counters(llm) -> dict | None:
    try:
        return next((c for c in llm.collective_rpc(drafter_counters, timeout=60) if c), None)
    except Exception as e:  # noqa: BLE001 - a report, not the run: say why it is missing
        return {"error": f"{type(e).__name__}: {e}"[:300]}
