"""The math-verify subprocess behind :func:`consensus_spec.voting.answers.equivalent`.

Every sympy operation runs in a helper subprocess: sympy can hang inside C
code (``10^{10^{10}}``, huge factorials) where no signal can interrupt it, so
the only safe guard is a process we are allowed to kill.  This also makes
comparisons thread-safe (math-verify's own timeout needs SIGALRM and the main
thread).  If the helper cannot run, :meth:`MathEngine.equal` answers False
for distinct strings, so callers fall back to canonical-string equality.
Model output is never evaluated as Python.

The worker loads this file by path, without importing the package (or
vLLM), so this module must not use relative imports.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import subprocess
import sys
import threading
import zlib
from collections import OrderedDict

logger = logging.getLogger(__name__)

__all__ = ["ENGINE", "MathEngine"]  # the rest internal: use consensus_spec.voting.answers


def _close(xs: list[complex], ys: list[complex]) -> bool:
    # Values at a fixed point differ => the expressions differ.  Looser than
    # math-verify's own tolerance (6 decimals), so "not close" can safely skip
    # the sympy comparison.
    return any(abs(x - y) <= 1e-5 * max(1.0, abs(x), abs(y)) for x in xs for y in ys)


class MathEngine:
    """Parent-side client of the sympy subprocess, with result caches."""

    CACHE_SIZE = 8192
    STARTUP_S = 120.0  # importing sympy + math-verify on a busy machine
    GRACE_S = 3.0  # on top of timeout_s before the worker is killed

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one request to the worker at a time
        self._cache_lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner = os.getpid()  # a forked child must not share our worker
        self._conn_in = self._conn_out = None
        self._disabled = False
        self._parsed: OrderedDict[str, list[complex] | bool] = OrderedDict()
        self._verified: OrderedDict[tuple[str, str], bool] = OrderedDict()

    def equal(self, a: str, b: str, timeout_s: float) -> bool:
        if a == b:
            return True
        pair = (a, b) if a < b else (b, a)
        with self._cache_lock:
            hit = self._verified.get(pair)
        if hit is not None:
            return hit
        fa, fb = self._fingerprint(a, timeout_s), self._fingerprint(b, timeout_s)
        if fa is False or fb is False:  # unparseable: distinct strings differ
            result = False
        elif isinstance(fa, list) and isinstance(fb, list) and not _close(fa, fb):
            result = False
        else:
            result = self._call(("verify", a, b, timeout_s), timeout_s) is True
        with self._cache_lock:
            _remember(self._verified, pair, result, self.CACHE_SIZE)
        return result

    def cache_sizes(self) -> dict[str, list[int]]:
        """[entries held, bound] of the parent's result caches."""
        with self._cache_lock:
            return {"math_parsed": [len(self._parsed), self.CACHE_SIZE],
                    "math_verified": [len(self._verified), self.CACHE_SIZE]}

    def _fingerprint(self, text: str, timeout_s: float) -> list[complex] | bool:
        """Value(s) at a fixed test point (see the worker); True if parsed but
        not evaluable (sets, equations...); False if unparseable or timed out."""
        with self._cache_lock:
            hit = self._parsed.get(text)
        if hit is None:
            res = self._call(("parse", text, timeout_s), timeout_s)
            hit = False if res is None else res  # timeouts are cached as failures
            with self._cache_lock:
                _remember(self._parsed, text, hit, self.CACHE_SIZE)
        return hit

    def _call(self, msg: tuple, timeout_s: float):
        """Send one op; None on timeout, crash or unavailable worker."""
        with self._lock:
            if not self._ensure_started():
                return None
            try:
                self._conn_out.send(msg)
                if self._conn_in.poll(max(0.1, timeout_s) + self.GRACE_S):
                    reply = self._conn_in.recv()
                    return reply[1] if reply[0] == "ok" else None
                logger.warning("answer worker stuck on %.80r; restarting it", msg[1])
            except (OSError, EOFError):
                logger.warning("answer worker died; restarting it")
            self._stop()
            return None

    def _ensure_started(self) -> bool:
        if self._owner != os.getpid():  # we were forked: start our own worker
            self._owner, self._proc, self._conn_in, self._conn_out = os.getpid(), None, None, None
        if self._proc is not None and self._proc.poll() is None:
            return True
        if self._disabled:
            return False
        from multiprocessing.connection import Connection

        self._stop()
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        loader = (
            "import importlib.util as u,sys;"
            "s=u.spec_from_file_location('_consensus_answers_worker',sys.argv[1]);"
            "m=u.module_from_spec(s);sys.modules[s.name]=m;s.loader.exec_module(m);"
            "m._worker_main(int(sys.argv[2]),int(sys.argv[3]))"
        )
        try:
            # Loaded by path so the child does not import the package (and vLLM).
            self._proc = subprocess.Popen(
                [sys.executable, "-c", loader, os.path.abspath(__file__),
                 str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C goes to the parent only
            )
        except OSError:
            os.close(to_child_w)
            os.close(from_child_r)
            self._disable("cannot start answer worker")
            return False
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self._conn_out = Connection(to_child_w, readable=False)
        self._conn_in = Connection(from_child_r, writable=False)
        try:
            if self._conn_in.poll(self.STARTUP_S) and self._conn_in.recv() == ("ready",):
                return True
        except (OSError, EOFError):
            pass
        self._disable("answer worker failed to start (is math-verify installed?)")
        return False

    def _disable(self, why: str) -> None:
        logger.warning("%s; comparing answers as canonical strings only", why)
        self._disabled = True
        self._stop()

    def _stop(self) -> None:
        for conn in (self._conn_in, self._conn_out):
            if conn is not None:
                conn.close()
        self._conn_in = self._conn_out = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._stop()


def _remember(cache: OrderedDict, key, value, size: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)


ENGINE = MathEngine()  # the process's one client (answers.equivalent asks it)
atexit.register(ENGINE.close)


# ---------------------------------------------------------------------------
# Worker process (runs math-verify; everything here may be killed at any time)
# ---------------------------------------------------------------------------


class _Timeout(BaseException):
    """BaseException so that library ``except Exception`` blocks don't eat it."""


def _worker_main(read_fd: int, write_fd: int) -> None:
    import signal
    from multiprocessing.connection import Connection

    import math_verify.grader as grader
    import math_verify.parser as parser
    import sympy
    from math_verify import parse, verify

    # We pass timeout=None to math-verify (our SIGALRM guard replaces its own),
    # so silence its one-off "timeout disabled" warning.
    grader.TIMEOUT_WARNING_SHOWN = parser.TIMEOUT_WARNING_SHOWN = True
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    def on_alarm(signum, frame):
        raise _Timeout

    signal.signal(signal.SIGALRM, on_alarm)
    inp = Connection(read_fd, writable=False)
    out = Connection(write_fd, readable=False)
    parsed: OrderedDict[str, list] = OrderedDict()

    def get(text: str) -> list:
        if text not in parsed:
            _remember(parsed, text, parse(f"${text}$", parsing_timeout=None), 2048)
        return parsed[text]

    def point(symbol) -> float:
        # Same symbol name -> same value in every process: a stable test point.
        return 1.1 + (zlib.crc32(symbol.name.encode()) % 997) / 1250

    def fingerprint(text: str) -> list[complex] | bool:
        """Values of the parsed expression at a fixed point (constants are
        just their value); True when that is undefined, e.g. for sets."""
        items = get(text)
        expr = next((x for x in items if isinstance(x, sympy.Basic)), None)
        if expr is None:
            return False
        candidates = [expr]
        if (  # "X%" parses as X*UnevaluatedExpr(1/100); it may equal X or X/100
            isinstance(expr, sympy.Mul)
            and len(expr.args) == 2
            and expr.args[1] == sympy.UnevaluatedExpr(sympy.Rational(1, 100))
        ):
            candidates = [expr.args[0] / 100, expr.args[0]]
        values = []
        for c in candidates:
            if not isinstance(c, sympy.Expr) or not all(
                isinstance(x, sympy.Symbol) for x in c.free_symbols
            ):
                return True
            try:
                v = complex(c.evalf(20, subs={x: point(x) for x in c.free_symbols}))
            except (TypeError, ValueError, OverflowError, ArithmeticError):
                return True
            if not (math.isfinite(v.real) and math.isfinite(v.imag)):
                return True
            values.append(v)
        return values

    out.send(("ready",))
    while True:
        try:
            op, *args = inp.recv()
        except (EOFError, OSError):
            return
        timeout_s = args[-1]
        try:
            signal.setitimer(signal.ITIMER_REAL, max(0.05, timeout_s))
            try:
                if op == "parse":
                    result = fingerprint(args[0])
                else:  # verify is asymmetric (gold, pred): accept either way
                    a, b = get(args[0]), get(args[1])
                    result = bool(verify(a, b, timeout_seconds=None)) or bool(
                        verify(b, a, timeout_seconds=None)
                    )
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            reply = ("ok", result)
        except _Timeout:
            reply = ("timeout",)
        except Exception as e:  # noqa: BLE001 - report, keep serving
            reply = ("error", type(e).__name__)
        out.send(reply)
