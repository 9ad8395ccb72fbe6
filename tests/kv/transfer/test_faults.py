"""Prefill/decode faults that need their own engines: a prefill instance without room to stage
answers null params (and the decode leg without them computes), and a pull slower than the
timeout is abandoned for a recompute, its late bytes landing in a retired buffer."""

from __future__ import annotations

import threading
import time

from loomserve.kv.transfer import InProcTransfer
from tests.kv.transfer.conftest import GREEDY, ONE, leg, make, tokens


def test_no_room_to_stage_gives_null_params():
    a = make("tiny-llama", "prefill")
    try:
        page = a.core.runner.kv_cache_config.page_bytes
        a.core.config.control.kv_transfer_buffer = 2 * page  # two pages: a 6-block prompt
        out = leg(a, "p", tokens(100, 1), ONE, {"do_remote_decode": True})
        assert out.finished and out.kv_transfer_params is None
        assert a.core.transfer.source.counters["no_room"] == 1
        # a short prompt still fits
        assert leg(a, "p2", tokens(40, 2), ONE, {"do_remote_decode": True}).kv_transfer_params
    finally:
        a.close()


class SlowTransfer(InProcTransfer):
    """Reads wait for `gate` (a slow network), then copy."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def read(self, session, ops):
        self.gate.wait(30)
        super().read(session, ops)


def test_slow_pull_times_out_and_recomputes():
    ref, a, b = make("tiny-llama"), make("tiny-llama", "prefill"), make("tiny-llama", "decode")
    slow = SlowTransfer()
    try:
        b.core.transfer._transfer = slow
        b.core.transfer.peer.read_timeout_s = 0.3
        prompt = tokens(100, 3)
        want = leg(ref, "r", prompt, GREEDY).token_ids
        params = leg(a, "p", prompt, ONE, {"do_remote_decode": True}).kv_transfer_params
        t0 = time.monotonic()
        out = leg(b, "d", prompt, GREEDY, params)
        assert time.monotonic() - t0 < 20
        assert out.token_ids == want and out.num_cached_tokens == 0
        peer = b.core.transfer.peer
        assert peer.counters["failed_reads"] >= 1 and peer.counters["pages_read"] == 0
        assert peer.stats.healthy  # a slow peer is a miss, not a tier fault
    finally:
        slow.gate.set()
        for e in (ref, a, b):
            e.close()
        slow.close()
