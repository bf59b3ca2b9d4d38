"""The package as an earlier commit had it, imported beside this one, so a
benchmark can time the previous code against the current one in one run
(and check that both draft alike).

``load(ref)`` extracts ``consensus_spec/`` at git ``ref`` with ``git
archive`` into ``results/previous/<commit>/`` (once; numba caches its
kernels there too) and imports it as the package ``consensus_spec_<commit>``:
the package imports itself relatively, so both live in one process without
touching each other. Needs a git checkout holding that commit (a shallow
clone may lack it: ``git fetch --unshallow``).
"""

from __future__ import annotations

import importlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo
# what `python -m evals propose-time` compares against by default: main before the
# kernels got public names and the guard checked settled buckets (2026-12-07), so
# both codes draft alike and both have the drafter's public halves the phase split
# times (2df8630, the default before, drafts otherwise on some 256-row runs, since
# the guard weighs the drafter's time: docs/host_time.md)
PREVIOUS = "5cc4525"


def _git(*args: str) -> bytes:
    try:
        return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True).stdout
    except FileNotFoundError:
        raise ValueError("git not found: the previous code is read from the repository's "
                         "history") from None
    except subprocess.CalledProcessError as e:
        raise ValueError(f"git {' '.join(args)} failed: {e.stderr.decode(errors='replace').strip()}"
                         " (a shallow clone may lack the commit: git fetch --unshallow)") from None


def load(ref: str = PREVIOUS):
    """The ``consensus_spec`` package at git ``ref``, imported under its own name."""
    if not re.fullmatch(r"[0-9A-Za-z._/~^-]+", ref):
        raise ValueError(f"not a git revision: {ref!r}")
    commit = _git("rev-parse", "--verify", "--short=7", f"{ref}^{{commit}}").decode().strip()
    name = f"consensus_spec_{commit}"
    if name in sys.modules:
        return sys.modules[name]
    root = os.path.join(REPO, "results", "previous", commit)
    if not os.path.isfile(os.path.join(root, name, "__init__.py")):
        tmp = root + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(fileobj=io.BytesIO(_git("archive", commit, "consensus_spec"))) as tar:
            tar.extractall(tmp, filter="data")
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.replace(os.path.join(tmp, "consensus_spec"), os.path.join(root, name))
        shutil.rmtree(tmp, ignore_errors=True)
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(name)
