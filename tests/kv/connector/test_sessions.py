"""Sessions through the tier connector: a session's turn end writes its pages down and
registers them for a prefetch before its predicted return."""

from __future__ import annotations

import time

from loomserve.kv.hashing import hash_chain
from tests.kv.connector.conftest import BS, GREEDY, A, drain, settle, small_llm


def test_session_pause_registers_prefetch(page_bytes, reference):
    llm = small_llm(page_bytes, host_cache_memory=str(page_bytes * 64))
    core = llm.core
    try:
        r = llm.inputs.make_request("s1", A, GREEDY, session_id="sess")
        core.add_request(r)
        while core.has_work():
            core.step()
        assert r.output_token_ids == reference[tuple(A)]
        assert core.tiers.counters["session_pauses"] == 1
        assert "sess" in core.tiers.store.sessions.paused
        settle(llm)
    finally:
        llm.close()


def test_paused_session_is_prefetched_into_host_before_its_return(tmp_path, page_bytes,
                                                                   reference):
    llm = small_llm(page_bytes, host_cache_memory=str(page_bytes * 64),
                    disk_cache_dir=str(tmp_path / "kv"), disk_cache_size=str(page_bytes * 256))
    core = llm.core
    conn = core.tiers
    host = conn.store.host
    keys = conn.keyspaces[0].keys(hash_chain(A, BS)[:6])

    def turn(i):
        r = llm.inputs.make_request(f"t{i}", A, GREEDY, session_id="sess")
        core.add_request(r)
        drain(core)
        assert r.output_token_ids == reference[tuple(A)]

    try:
        turn(0)
        time.sleep(0.3)  # think time, learned when the next turn arrives
        turn(1)
        settle(llm)
        host.clear()  # the pause pushed the session's pages out of host memory
        assert not any(host.contains(keys))
        deadline = time.monotonic() + 5
        while not all(host.contains(keys)) and time.monotonic() < deadline:
            time.sleep(0.02)
            core.idle()  # the engine polls prefetches every step and while idle
        assert all(host.contains(keys)), "the session's pages were not prefetched"
        assert conn.store.counters["prefetches"] >= 1
    finally:
        llm.close()

