"""A vLLM OpenAI API server as a child process, for benchmarks: its own
process group (always stopped, SIGKILL after a grace period), a health wait,
and the CPU time of its whole process tree (API server, engine core,
workers) read from /proc."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_cpu_s(pid: int) -> float:
    """user + system CPU seconds of ``pid`` and its live descendants."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            continue
    return total / tick


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server <args>`` on a free port."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        self.port = free_port()
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                    "--host", HOST, "--port", str(self.port), *args]
        self.log_path, self.env = Path(log_path), env or {}
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> "VllmServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, env={**os.environ, **self.env}, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 600.0) -> float:
        import requests

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); log: {self.log_path}")
            try:
                if requests.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not healthy after {timeout:.0f} s; log: {self.log_path}")

    def cpu_s(self) -> float:
        return tree_cpu_s(self.proc.pid)

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=10)
        self._log.close()
