"""The scheduler side of the tier connector through the engine: a tier lookup or load in
flight never stalls other requests, one prefix is loaded once, a finished load releases its rows
whatever the queue does, an aborted load keeps its rows until the tier is done writing them, and
a corrupt page shortens the hit to the pages before it."""

from __future__ import annotations

import threading
import time

from loomserve.engine.sched.request import RequestStatus
from loomserve.kv.connector import loads
from loomserve.kv.hashing import hash_chain
from loomserve.kv.tiers import DiskTier, TieredStore, codec
from tests.execution.conftest import make_llm
from tests.kv.connector.conftest import (
    BS,
    GREEDY,
    OTHERS,
    A,
    drain,
    evict_a,
    prompt,
    run,
    settle,
    small_llm,
)


def test_corrupt_disk_page_is_a_miss(tmp_path, page_bytes, reference, monkeypatch):
    monkeypatch.setattr(loads, "LOAD_CHUNK_BLOCKS", 2)  # loads of [0,2) [2,4) [4,6)
    kw = dict(disk_cache_dir=str(tmp_path / "kv"), disk_cache_size=str(page_bytes * 256))
    llm = small_llm(page_bytes, **kw)
    try:
        assert run(llm, A).token_ids == reference[tuple(A)]
        settle(llm)
        disk = llm.core.tiers.store.tier("disk")
        key = llm.core.tiers.keyspaces[0].key(hash_chain(A, BS)[2])
        path = disk.path_of(key)
        data = bytearray(path.read_bytes())
        data[codec.HEADER_BYTES + 100] ^= 0xFF  # one flipped byte inside block 2's page
        path.write_bytes(bytes(data))
        evict_a(llm, reference)
        out = run(llm, A)
        assert out.token_ids == reference[tuple(A)]
        # blocks 0-1 loaded; 2 is corrupt, so 3-5 (loaded by their own chunks) are not a
        # prefix: recomputed
        assert out.num_tier_cached_tokens == 2 * BS
        assert llm.core.tiers.counters["short_loads"] == 1
        assert disk.stats.corrupt >= 1  # dropped, then written again from the recompute
        settle(llm)
    finally:
        llm.close()


class SlowDisk(DiskTier):
    """A real disk tier whose lookups wait for `lookup_gate` and reads for `read_gate` (a slow
    backend)."""

    index_in_memory = False  # its contains() may block: the engine must not ask inline

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.lookup_gate = threading.Event()
        self.read_gate = threading.Event()
        self.open()

    def open(self) -> None:
        self.lookup_gate.set()
        self.read_gate.set()

    def contains(self, keys):
        self.lookup_gate.wait(30)
        return super().contains(keys)

    def get_into(self, keys, out, rows=None):
        self.read_gate.wait(30)
        return super().get_into(keys, out, rows)


def slow_store(tmp_path, page_bytes):
    disk = SlowDisk(tmp_path / "slow", page_bytes * 256, page_bytes, fsync=False)
    return disk, TieredStore([disk], op_timeout_s=30.0)


def test_slow_tier_lookup_does_not_block_other_requests(tmp_path, page_bytes, reference):
    llm = small_llm(page_bytes)
    disk, store = slow_store(tmp_path, page_bytes)
    conn = llm.core.attach_tiers(store)
    core = llm.core
    try:
        assert run(llm, A).token_ids == reference[tuple(A)]
        settle(llm)
        evict_a(llm, reference)
        disk.lookup_gate.clear()
        a = llm.inputs.make_request("a", A, GREEDY)
        b = llm.inputs.make_request("b", OTHERS[-1], GREEDY)  # a full device hit: no lookup
        core.add_request(a)  # queue head, its lookup hangs
        core.add_request(b)
        for _ in range(20):
            core.step()
            if b.status.finished:
                break
        assert b.status == RequestStatus.FINISHED_LENGTH, "b waited behind a's tier lookup"
        assert b.output_token_ids == reference[tuple(OTHERS[-1])]
        assert a.status == RequestStatus.WAITING and conn.num_inflight == 1
        disk.open()
        drain(core)
        assert a.status == RequestStatus.FINISHED_LENGTH
        assert a.output_token_ids == reference[tuple(A)]
        assert a.num_tier_cached_tokens == 96
        settle(llm)
    finally:
        disk.open()
        llm.close()


def test_same_prefix_is_loaded_once(tmp_path, page_bytes, reference):
    llm = small_llm(page_bytes)
    disk, store = slow_store(tmp_path, page_bytes)
    conn = llm.core.attach_tiers(store)
    core = llm.core
    try:
        run(llm, A)
        settle(llm)
        evict_a(llm, reference)
        loads = conn.counters["loads"]
        disk.read_gate.clear()
        reqs = [llm.inputs.make_request(f"a{i}", A, GREEDY) for i in range(2)]
        for r in reqs:
            core.add_request(r)
        for _ in range(10):
            core.step()
        assert conn.counters["loads"] == loads + 1  # the second waits for the first's load
        assert all(r.status == RequestStatus.WAITING for r in reqs)
        disk.open()
        drain(core)
        for r in reqs:
            assert r.output_token_ids == reference[tuple(A)]
        # whichever lookup came back first loaded; the other hit what it loaded on the device
        assert sorted(r.num_tier_cached_tokens for r in reqs) == [0, 96]
        assert [r.num_cached_tokens for r in reqs] == [96, 96]
        assert conn.counters["loads"] == loads + 1
        settle(llm)
    finally:
        disk.open()
        llm.close()


def test_finished_load_releases_rows_though_the_queue_head_is_stuck(tmp_path, page_bytes,
                                                                    reference, monkeypatch):
    llm = small_llm(page_bytes)
    disk, store = slow_store(tmp_path, page_bytes)
    conn = llm.core.attach_tiers(store)
    core = llm.core
    try:
        run(llm, A)
        settle(llm)
        evict_a(llm, reference)
        disk.read_gate.clear()
        a = llm.inputs.make_request("a", A, GREEDY)
        core.add_request(a)
        deadline = time.monotonic() + 10
        pending = conn.loads.pending
        while ("a" not in pending or pending["a"].phase != "load") and \
                time.monotonic() < deadline:
            core.step()
        # a holds 6 of the 16 blocks; a long request jumps to the head and cannot fit beside it
        monkeypatch.setattr(loads, "MAX_ROUNDS", 0)  # it asks no tier: the head just waits
        big = prompt(7, 200)
        b = llm.inputs.make_request("b", big, GREEDY)
        core.add_request(b)
        core.scheduler.waiting.remove(b)
        core.scheduler.waiting.appendleft(b)
        core.step()
        assert b.status == RequestStatus.WAITING
        disk.open()
        deadline = time.monotonic() + 10
        while b.status == RequestStatus.WAITING and time.monotonic() < deadline:
            core.step()
        assert b.status != RequestStatus.WAITING, "a's finished load kept its rows"
        drain(core)
        assert a.output_token_ids == reference[tuple(A)]
        ref_big = make_llm(enable_prefix_caching=False).generate(big, GREEDY)[0].token_ids
        assert b.output_token_ids == ref_big
        settle(llm)
    finally:
        disk.open()
        llm.close()


def test_abort_during_load_keeps_rows_until_the_load_ends(tmp_path, page_bytes, reference):
    llm = small_llm(page_bytes)
    disk, store = slow_store(tmp_path, page_bytes)
    conn = llm.core.attach_tiers(store)
    core = llm.core
    try:
        run(llm, A)
        settle(llm)
        evict_a(llm, reference)
        disk.read_gate.clear()  # lookups answer, loads hang
        a = llm.inputs.make_request("a", A, GREEDY)
        core.add_request(a)
        deadline = time.monotonic() + 10
        pending = conn.loads.pending
        while ("a" not in pending or pending["a"].phase != "load") and \
                time.monotonic() < deadline:
            core.step()
        assert pending["a"].phase == "load" and not pending["a"].handle.done()
        assert core.kv.num_free_blocks == core.kv.num_blocks - 6  # a holds the rows
        core.abort("a")
        assert conn.num_inflight == 0 and conn.num_held_blocks == 6
        assert core.kv.num_free_blocks == core.kv.num_blocks - 6  # still held: being written
        disk.open()
        deadline = time.monotonic() + 10
        while conn.num_held_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
            core.idle()
        assert core.kv.num_free_blocks == core.kv.num_blocks
        # the aborted load cached nothing: A's blocks are not hittable on the device
        assert not any(h in core.kv.pool.cached[0] for h in hash_chain(A, BS)[:6])
        assert run(llm, A).token_ids == reference[tuple(A)]
    finally:
        disk.open()
        llm.close()
