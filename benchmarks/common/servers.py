"""Server plumbing for benchmarks: a free port, a server subprocess, the peer binaries.

`ServerProcess` starts a server in its own process group, polls `health_path` until it answers
200, and stops it (SIGINT, then SIGTERM, then SIGKILL) on exit; its combined output goes to a
temp file whose end `tail()` shows when the server fails to come up.

Invariants: only the process group the benchmark started is ever signalled; a server that
exits or stays unhealthy past `startup_timeout` raises with its log's tail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

from common.paths import BUILD_LLAMA_SERVER, LLAMA_SERVER_BIN

__all__ = ["free_port", "ServerProcess", "ensure_llama_server", "which_loomserve"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess: started in its own process group, polled on ``health_path``
    until it answers 200, and stopped (SIGINT, then SIGTERM, then SIGKILL) on exit.

    The combined stdout/stderr goes to a temp file; ``tail()`` shows its end when the
    server fails to come up.
    """

    def __init__(self, argv: Sequence[str], port: int, *, name: str = "server",
                 health_path: str = "/health", env: dict[str, str] | None = None,
                 startup_timeout: float = 600.0) -> None:
        self.argv = list(argv)
        self.port = port
        self.name = name
        self.base_url = f"http://127.0.0.1:{port}"
        self.health_path = health_path
        self.env = env
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        import httpx

        print(f"[{self.name}] starting: {' '.join(self.argv)}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env,
                                     start_new_session=True)
        url = self.base_url + self.health_path
        with httpx.Client(timeout=5.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode} "
                                       f"before becoming healthy:\n{self.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url).status_code == 200:
                        break
                if time.monotonic() - t0 > self.startup_timeout:
                    self.stop()
                    raise TimeoutError(f"{self.name} not healthy after {self.startup_timeout}s:"
                                       f"\n{self.tail()}")
                time.sleep(0.25)
        print(f"[{self.name}] healthy after {time.monotonic() - t0:.1f}s on {self.base_url}",
              file=sys.stderr, flush=True)

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, 15), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)  # its own session: only what we started
            try:
                p.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        with open(self.log.name, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")


def ensure_llama_server(build: bool = True) -> str:
    """Path of the llama-server binary, building it (slow) when missing and ``build``."""
    if not os.access(LLAMA_SERVER_BIN, os.X_OK):
        if not build:
            raise FileNotFoundError(f"{LLAMA_SERVER_BIN} missing: run {BUILD_LLAMA_SERVER}")
        subprocess.run(["bash", BUILD_LLAMA_SERVER], check=True)
    return LLAMA_SERVER_BIN


def which_loomserve() -> list[str]:
    """argv prefix that runs the loomserve CLI (the console script, else ``-m``)."""
    exe = shutil.which("loomserve", path=os.path.dirname(sys.executable) + os.pathsep
                       + os.environ.get("PATH", ""))
    return [exe] if exe else [sys.executable, "-m", "loomserve.cli"]
