"""``--isa``: run any evals command as on a CPU with a smaller instruction set.

Most laptops and many cloud and AMD servers have AVX2 and no AVX-512, and
what pays there differs: vLLM's CPU build has one kernel library per ISA,
oneDNN has no bf16 matmul without AVX-512, so a bf16 model's linear layers
fall back to PyTorch's (emulated bf16) and every token costs several times
more. ``python -m evals --isa avx2 <command> ...`` (or ``--isa avx2``
anywhere after the command) makes every library in every process the run
starts pick its AVX2 code on an AVX-512 machine:

- PyTorch's own kernels: ``ATEN_CPU_CAPABILITY=avx2``;
- oneDNN: ``ONEDNN_MAX_CPU_ISA=AVX2``; MKL: ``MKL_ENABLE_INSTRUCTIONS=AVX2``;
- numba (the drafter's kernels): ``NUMBA_CPU_NAME=haswell``;
- vLLM loads ``_C_AVX2`` (not ``_C``) and picks no AVX-512 or AMX paths: it
  asks ``torch.cpu._is_avx512_supported()`` and its kin, which no variable
  changes, so a ``sitecustomize`` (``evals/isa_site/``, put on
  ``PYTHONPATH`` for this run only) answers them as an AVX2 CPU would, in
  every Python process the run starts (servers and engine cores included).

It is an emulation: the same cores, caches and memory, other instructions.
The command re-executes itself with that environment; the child checks the
result and says which ISA it runs (``describe``).
"""

from __future__ import annotations

import os
import sys

ENV = "CONSENSUS_SPEC_ISA"
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "isa_site")
ISAS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", "NUMBA_CPU_NAME": "haswell"},
}


class IsaError(ValueError):
    pass


def pop_isa(argv: list[str]) -> str | None:
    """Remove ``--isa X`` / ``--isa=X`` from ``argv`` (in place); X or None."""
    for i, arg in enumerate(argv):
        if arg == "--isa":
            if i + 1 >= len(argv):
                raise IsaError(f"--isa needs a value: {', '.join(ISAS)}")
            value = argv[i + 1]
            del argv[i:i + 2]
            break
        if arg.startswith("--isa="):
            value = arg.split("=", 1)[1]
            del argv[i]
            break
    else:
        return None
    if value not in ISAS:
        raise IsaError(f"unknown --isa {value!r}: choose from {', '.join(ISAS)}")
    if pop_isa(argv) not in (None, value):
        raise IsaError("--isa given twice with different values")
    return value


def environment(isa: str, env: dict | None = None) -> dict:
    """``env`` (default: this process's) with ``isa``'s variables set and
    the sitecustomize on ``PYTHONPATH``."""
    env = dict(os.environ if env is None else env)
    if isa == "native":
        return env
    env.update(ISAS[isa])
    env[ENV] = isa
    path = env.get("PYTHONPATH", "")
    if SITE_DIR not in path.split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (SITE_DIR, path) if p)
    return env


def reexec_if_needed(isa: str | None, argv: list[str]) -> None:
    """Re-execute ``python -m evals argv`` under ``isa`` unless this process
    already runs under it (variables must be set before torch is imported)."""
    if isa is None or isa == "native" or os.environ.get(ENV) == isa:
        return
    os.execve(sys.executable, [sys.executable, "-m", "evals", *argv], environment(isa))


def describe() -> str:
    """The ISA this process's libraries use, checked, in a few words;
    raises IsaError where an emulated ISA did not take."""
    isa = os.environ.get(ENV)
    if not isa:
        return "native"
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability.lower() != isa or torch.cpu._is_avx512_supported():
        raise IsaError(f"--isa {isa} did not take: torch reports {capability}, AVX-512 "
                       f"{torch.cpu._is_avx512_supported()} (is another sitecustomize first on the path?)")
    return f"{isa} (emulated: torch {capability}, vLLM _C_AVX2, numba haswell, oneDNN/MKL AVX2)"
