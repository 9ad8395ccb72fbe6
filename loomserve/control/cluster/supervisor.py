"""Starting, watching and stopping a cluster's processes on this machine.

Every child runs in its own session (process group), so a terminal's Ctrl-C reaches only the
supervisor, which then stops the children in order: the router first (no new requests go to
instances being stopped), then the instances. A stop is SIGTERM to the child, then SIGKILL to its
whole group after `stop_timeout`, and a final SIGKILL to the group in any case so no engine core
process outlives its server.

Invariants: every wait has a deadline; a child that fails to start is reported with the tail
of its log and everything started so far is stopped; `Supervisor.stop` is idempotent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

__all__ = ["Child", "StartError", "Supervisor", "log_tail"]


class StartError(RuntimeError):
    """A child did not come up; the message carries its log tail."""


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


@dataclass
class Child:
    name: str
    cmd: list[str]
    log: Path
    health_url: str
    any_status: bool = False      # True: any HTTP answer is "up" (a router with no instance up)
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_restart: float = 0.0
    down_since: float | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} start: "
                      f"{' '.join(self.cmd)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def healthy(self, timeout: float = 1.0) -> bool:
        try:  # urllib, not httpx: `loomserve` builds this parser with core dependencies only
            with urllib.request.urlopen(self.health_url, timeout=timeout) as r:
                return r.status == 200 or self.any_status
        except urllib.error.HTTPError:
            return self.any_status  # an answer, with an error status
        except (OSError, ValueError):
            return False

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if not self.alive():
                raise StartError(f"{self.name} exited with {self.proc.returncode} before it was "
                                 f"healthy; last lines of {self.log}:\n{log_tail(self.log)}")
            if time.monotonic() > deadline:
                raise StartError(f"{self.name} was not healthy at {self.health_url} within "
                                 f"{timeout:.0f}s; last lines of {self.log}:\n"
                                 f"{log_tail(self.log)}")
            time.sleep(0.25)

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(self.proc.pid)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _kill_group(pgid: int, timeout: float = 5.0) -> None:
    """SIGKILL whatever is left in the child's process group (its engine core, say) and wait,
    up to `timeout`, until the group is empty (its orphans reaped)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


class Supervisor:
    """Instances and an optional router as child processes; see the module docstring."""

    def __init__(self, instances: list[Child], router: Child | None, *, restart: bool = False,
                 start_timeout: float = 300.0, stop_timeout: float = 15.0,
                 log: Callable[[str], None] = print) -> None:
        self.instances, self.router = instances, router
        self.restart, self.start_timeout, self.stop_timeout = restart, start_timeout, stop_timeout
        self.log = log
        self._stopping = False

    def children(self) -> list[Child]:
        return self.instances + ([self.router] if self.router else [])

    def start(self) -> None:
        """All instances at once (their model loads overlap), each waited for; then the router.
        Raises StartError after stopping everything when one does not come up."""
        try:
            for c in self.instances:
                c.start()
            for c in self.instances:
                c.wait_healthy(self.start_timeout)
            if self.router:
                self.router.start()
                self.router.wait_healthy(min(self.start_timeout, 60.0))
        except BaseException:
            self.stop()
            raise

    def state(self) -> dict:
        return {c.name: {"pid": c.pid, "health": c.health_url, "log": str(c.log),
                         "restarts": c.restarts, "alive": c.alive()} for c in self.children()}

    def write_state(self, path: Path) -> None:
        path.write_text(json.dumps(self.state(), indent=1))

    def watch_once(self) -> int | None:
        """One supervision pass. Returns an exit code when the cluster must end: 1 when the
        router died, or when no router runs here and every instance is down for good."""
        now = time.monotonic()
        if self.router and not self.router.alive():
            self.log(f"cluster: the router exited with {self.router.proc.returncode}; stopping "
                     f"everything. Last lines of {self.router.log}:\n"
                     f"{log_tail(self.router.log)}")
            return 1
        for c in self.instances:
            if c.alive():
                continue
            if c.down_since is None:
                c.down_since = now
                c.next_restart = now + min(30.0, 2.0 ** c.restarts)
                self.log(f"cluster: {c.name} (pid {c.pid}) exited with {c.proc.returncode}"
                         + ("; the router takes it out" if self.router else "")
                         + (f"; restarting in {c.next_restart - now:.0f}s" if self.restart
                            else "") + f". Last lines of {c.log}:\n{log_tail(c.log, 10)}")
            elif self.restart and now >= c.next_restart:
                c.restarts += 1
                c.down_since = None
                self.log(f"cluster: restarting {c.name} (restart {c.restarts})")
                c.start()
        if not self.router and not self.restart and not any(c.alive() for c in self.instances):
            self.log("cluster: every instance on this node is down")
            return 1
        return None

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self.router:
            self.router.stop(self.stop_timeout)
        # SIGTERM every instance first so they drain in parallel, then collect each.
        for c in self.instances:
            if c.alive():
                try:
                    c.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for c in self.instances:
            c.stop(self.stop_timeout)
