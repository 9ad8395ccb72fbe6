"""The machine a benchmark runs on: its fingerprint and torch's thread count.

`host_info` is stored beside every result (CPU model, the vector extensions that matter here,
cores, affinity, Python, load average at the start), so a figure can always be traced to the
machine and its load. `llama_repack_args` runs llama-server's weight repacking as its users do.

Invariant: `torch_threads` restores the previous thread count on exit, also on error.
"""

from __future__ import annotations

import contextlib
import os
import platform
from typing import Any, Iterator

from loomserve.execution.kernels import cpu_flags

__all__ = ["host_info", "llama_repack_args", "torch_threads"]

# The instruction-set extensions that change the kernels' speed (AMD EPYC VMs here differ in them).
_ISA = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def llama_repack_args(repack: bool | None = None) -> list[str]:
    """llama-server's repacked weight layouts: with None on (its default, as its users run it)
    except where the CPU reports AMX, whose buffer type crashed in ldtilecfg on an Intel VM
    here; True / False force them on / off."""
    if repack is None:
        repack = "amx_tile" not in cpu_flags().split()
    return [] if repack else ["--no-repack"]


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
    flags = cpu_flags().split()
    return {"cpu": cpu, "isa": [f for f in _ISA if f in flags], "nproc": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)),
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
