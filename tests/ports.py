"""Ports for the servers tests start: free, and out of the way of the kernel's own picks.

A port taken with bind(('127.0.0.1', 0)) comes from the ephemeral range, so between the test
choosing it and the server binding it, any other bind(0) on the host (a server started just
before: its KV-event publisher, its transfer engine) may take it ("address already in use").
Ports here come from below the ephemeral range (Linux: 32768 and up by default), which bind(0)
never hands out, and a port is never handed out twice in one test process.
"""

from __future__ import annotations

import os
import random
import socket

LOW, HIGH = 20000, 32000
_given: set[int] = set()


def _worker_range(low: int, high: int) -> tuple[int, int]:
    """This pytest-xdist worker's share of [low, high) (gw0, gw1, ... of PYTEST_XDIST_WORKER_COUNT):
    two workers never hand out the same port. The whole range outside xdist."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get(
        "PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit()):
        return low, high
    step = (high - low) // max(1, int(count))
    first = low + int(worker[2:]) * step
    return first, first + step


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port no socket holds now, outside the ephemeral range, not given out before."""
    low, high = _worker_range(LOW, min(HIGH, _ephemeral_low()))
    for _ in range(1000):
        port = random.randrange(low, high)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{high}")
