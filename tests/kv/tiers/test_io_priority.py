"""Tier and transfer I/O threads run below the thread that started them (io_priority)."""

from __future__ import annotations

import os
import threading

import pytest

from loomserve.kv.tiers import io_priority


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priorities here")
def test_io_pool_threads_are_nicer_than_the_engine_thread():
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pool = io_priority.io_pool(2, "test-io")
    try:
        got = pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        assert got.result() == min(19, mine + io_priority.IO_NICE)
        assert io_priority.IO_NICE > 0  # the default lowers them
    finally:
        pool.shutdown()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # caller unchanged
