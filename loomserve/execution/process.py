"""Process lifetime: an engine core or a worker rank never outlives the process that started
it."""

from __future__ import annotations

import ctypes
import os
import signal
import sys


def die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel SIGKILLs this process when its parent dies (PR_SET_PDEATHSIG), so a
    core whose front end was killed never lives on, even in the middle of a long step (the
    loop's own parent check only runs between steps). Elsewhere the loop's check remains.
    Caveat of the mechanism: the signal follows the spawning *thread*; the front end spawns
    the core from a thread that lives as long as it does (the main thread in `serve`)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)
