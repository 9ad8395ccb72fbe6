"""Tier and KV-transfer I/O threads run below the engine thread's scheduling priority.

On a CPU host the engine thread's steps share the cores with the tiers' copies, checksums and
network reads. A prefill/decode handover of a 6K-token prompt (~280 MB of fp32 KV pulled,
checksummed and copied into the pool) would otherwise take half of the engine thread's core for
about a second and stretch one decode step of every stream by as much. Each I/O pool's threads
lower their own priority when they start (Linux per-thread nice, relative to the process's:
os.setpriority on the thread id; threads they create, such as a transfer engine's, inherit it),
so the engine thread wins the CPU whenever it is runnable and the I/O takes the idle time.
IO_NICE: environment LOOMSERVE_IO_NICE, default 10, 0 = unchanged. Lowering a priority needs no
privilege; where it fails, nothing changes.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

IO_NICE = int(os.environ.get("LOOMSERVE_IO_NICE", "10"))


def lower_priority() -> None:
    """Make the calling thread IO_NICE nicer than it is (at most 19)."""
    if IO_NICE <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + IO_NICE))
    except OSError:
        pass


def io_pool(threads: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run below the engine thread."""
    return ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=lower_priority)
