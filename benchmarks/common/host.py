"""The machine a benchmark runs on: its fingerprint and torch's thread count.

`host_info` is stored beside every result (CPU model, cores, affinity, Python, load average at
the start), so a figure can always be traced to the machine and its load.

Invariant: `torch_threads` restores the previous thread count on exit, also on error.
"""

from __future__ import annotations

import contextlib
import os
import platform
from typing import Any, Iterator

__all__ = ["host_info", "torch_threads"]


def host_info() -> dict[str, Any]:
    """A small fingerprint of the machine, stored beside every result."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {"cpu": cpu, "nproc": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "hostname": platform.node(),
            "loadavg_at_start": [round(x, 2) for x in load]}


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Temporarily set torch's intra-op thread count."""
    import torch

    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
