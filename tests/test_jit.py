"""consensus_spec.jit: kernels compiled on first use, cached, and never run
from a cache that is older than the code they call."""

import subprocess
import sys
import textwrap
from pathlib import Path

CALLEE = """
from consensus_spec.jit import Kernels

kernel = Kernels(globals())


@kernel
def value():
    return {value}
"""

CALLER = """
from consensus_spec.jit import Kernels

from . import callee
from .callee import value  # noqa: F401  (bound compiled)

kernel = Kernels(globals(), uses=(callee.kernel,))


@kernel
def doubled():
    return 2 * value()
"""

RUN = """
import sys
sys.path.insert(0, {root!r})
from pkg import caller
caller.kernel.compile()
print(caller.doubled())
"""


def _run(root: Path) -> int:
    out = subprocess.run([sys.executable, "-c", RUN.format(root=str(root))], check=True,
                         capture_output=True, text=True, timeout=300)
    return int(out.stdout.strip())


def test_a_cached_caller_runs_the_callee_it_calls_now(tmp_path):
    """Numba keys a cached kernel to its own file: a caller whose file did not
    change would keep its cached copy of the callee's old code. The
    registry's digest of the sources it calls into empties that cache."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "caller.py").write_text(textwrap.dedent(CALLER))
    (pkg / "callee.py").write_text(CALLEE.format(value=1))
    assert _run(tmp_path) == 2
    assert list((pkg / "__pycache__").glob("caller.doubled-*.nbi"))  # it was cached
    (pkg / "callee.py").write_text(CALLEE.format(value=21))  # only the callee changes
    assert _run(tmp_path) == 42
    assert _run(tmp_path) == 42  # and the new code is what stays cached


def test_kernels_without_a_cache_compile_and_run(tmp_path, monkeypatch):
    """Where numba finds no writable cache location the kernels compile per
    process, with nothing to empty (numba's NullCache has no path)."""
    from consensus_spec.jit import Kernels

    source = tmp_path / "mod.py"
    source.write_text("def one():\n    return 1\n")
    namespace = {"__file__": str(source)}
    exec(source.read_text(), namespace)
    registry = Kernels(namespace)
    registry(namespace["one"])
    import numba

    njit = numba.njit

    def no_cache(*args, **kwargs):
        if kwargs.get("cache"):
            raise RuntimeError("cannot cache function: no locator available")
        return njit(*args, **kwargs)

    monkeypatch.setattr(numba, "njit", no_cache)
    registry.compile()
    assert namespace["one"]() == 1
