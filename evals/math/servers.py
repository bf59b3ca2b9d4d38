"""A vLLM OpenAI API server as a child process, for benchmarks and the
server tests: its flags, its own process group (always stopped, SIGKILL
after a grace period; SIGTERM when the process that started it is killed),
a health wait, its log, and the CPU time of its whole process tree (API
server, engine core, workers) read from /proc."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HOST = "127.0.0.1"
PLUGINS = "consensus_spec_vllm_cpu_fixes,consensus_spec_self_consistency"  # VLLM_PLUGINS of the routes
SERVED = "consensus-tiny"  # --served-model-name


_PR_SET_PDEATHSIG = 1
# libc's prctl, looked up before any fork (a forked child only calls it); None off Linux
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def end_with_parent(sig: int, parent: int | None = None) -> bool:
    """Ask Linux to send this process ``sig`` when the thread that started
    it ends (``PR_SET_PDEATHSIG``); with ``parent``, exit at once if that
    parent has ended already. A parent killed by a signal runs none of its
    cleanup, and what it started would keep its engine's memory and cores
    busy under whatever runs next. False where it cannot (not Linux, or
    prctl refused)."""
    if _prctl is None or _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:  # it ended before the line above
        os._exit(1)
    return True


def _server_child() -> None:
    """In the server's process, between fork and exec: SIGTERM (vLLM's
    API server then shuts its engine core down) when its starter ends."""
    end_with_parent(signal.SIGTERM)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_args(model: str, spec: bool, max_num_seqs: int | None, max_model_len: int,
                dtype: str = "float32", memory: float = 0.1, num_speculative_tokens: int = 8) -> list[str]:
    """A server's flags; ``max_num_seqs`` None leaves vLLM's default; ``memory``
    is ``--gpu-memory-utilization`` (on CPU, a share of RAM)."""
    args = ["--model", model, "--served-model-name", SERVED, "--max-model-len", str(max_model_len),
            "--gpu-memory-utilization", str(memory), "--dtype", dtype, "--enforce-eager", "--seed", "0"]
    if max_num_seqs is not None:
        args += ["--max-num-seqs", str(max_num_seqs)]
    if spec:
        args += ["--speculative-config", json.dumps({
            "method": "custom_class", "model": "consensus_spec.ConsensusProposer",
            "num_speculative_tokens": num_speculative_tokens})]
    return args


def _stats(pids=None) -> dict[int, list[str]]:
    """/proc/PID/stat's fields after the command name, per live ``pids``
    (default: every process): state, ppid, pgrp, ..."""
    out = {}
    for pid in [int(e) for e in os.listdir("/proc") if e.isdigit()] if pids is None else pids:
        try:
            out[pid] = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants, read from /proc."""
    children: dict[int, list[int]] = {}
    for child, fields in _stats().items():
        children.setdefault(int(fields[1]), []).append(child)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def process_group(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    return [pid for pid, f in _stats().items() if int(f[2]) == pgid and f[0] != "Z"]


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server <args>`` on a free port,
    logging to ``log_path``; ``env`` is added to this process's environment.
    The server is sent SIGTERM when the thread that called :meth:`start`
    ends, so start it from one that outlives it (the main thread)."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None,
                 name: str = "vllm", cwd: Path | None = None):
        self.name, self.port = name, free_port()
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                    "--host", HOST, "--port", str(self.port), *args]
        self.log_path, self.env, self.cwd = Path(log_path), env or {}, cwd
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.ready_s: float | None = None
        self.exit_code: int | None = None
        self.stop_offset: int | None = None  # log size when stop() began
        self.leftover: list[int] = []  # group members alive after the SIGTERM
        self._stopped = False

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> "VllmServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env={**os.environ, **self.env},
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_server_child)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def health(self, timeout: float = 5.0) -> int | None:
        import requests
        try:
            return requests.get(self.base_url + "/health", timeout=timeout).status_code
        except requests.RequestException:
            return None

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Poll ``/health`` until 200 (bounded); raises with the log tail if
        the process dies or the deadline passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} server exited with {self.proc.returncode} "
                                   f"before becoming healthy ({self.log_path}):\n{self.log_tail()}")
            if self.health(timeout=2.0) == 200:
                self.ready_s = time.monotonic() - self.started_at
                return self.ready_s
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} server not healthy after {timeout:.0f} s "
                           f"({self.log_path}):\n{self.log_tail()}")

    def cpu_s(self) -> float:
        """user + system CPU seconds of the server and its live descendants."""
        ticks = sum(int(f[11]) + int(f[12]) for f in _stats(process_tree(self.proc.pid)).values())
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the API server (it shuts its engine down), SIGKILL the
        whole process group if the server is not gone after ``grace``
        seconds or left any process behind. Idempotent."""
        if self.proc is None or self._stopped:
            return
        self._stopped = True
        try:
            self.stop_offset = self.log_path.stat().st_size
        except OSError:
            self.stop_offset = 0
        pgid = self.proc.pid  # start_new_session: the server leads its own group
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10.0  # leader gone, children lingering: wait for them
        while self.proc.poll() is not None and process_group(pgid) and time.monotonic() < deadline:
            time.sleep(0.5)
        self.leftover = process_group(pgid)
        if self.leftover or self.proc.poll() is None:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.exit_code = self.proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self.exit_code = None
        self._log.close()

    def log_text(self, until_stop: bool = False) -> str:
        """The log (up to the moment :meth:`stop` began, if ``until_stop``)."""
        return self._read(0, self.stop_offset if until_stop else None)

    def shutdown_log(self) -> str:
        """What the server logged while being stopped."""
        return "" if self.stop_offset is None else self._read(self.stop_offset, None)

    def _read(self, start: int, end: int | None) -> str:
        try:
            return self.log_path.read_bytes()[start:end].decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
