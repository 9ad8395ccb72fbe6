"""Sessions through the tier connector: a session's turn end writes its pages down and
registers them for a prefetch before its predicted return; a subagent (parent_session_id set)
is not its parent's return, and its end brings the parent's prefetch forward."""

from __future__ import annotations

import time

from loomserve.kv.hashing import hash_chain
from tests.kv.connector.conftest import BS, GREEDY, OTHERS, A, drain, settle, small_llm


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


def tiered_llm(tmp_path, page_bytes):
    return small_llm(page_bytes, host_cache_memory=str(page_bytes * 64),
                     disk_cache_dir=str(tmp_path / "kv"), disk_cache_size=str(page_bytes * 256))


def submit(llm, rid, tokens, **session):
    r = llm.inputs.make_request(rid, tokens, GREEDY, **session)
    llm.core.add_request(r)
    drain(llm.core)
    return r


def test_subagent_is_not_its_parents_return(tmp_path, page_bytes, reference):
    llm = tiered_llm(tmp_path, page_bytes)
    sessions = llm.core.tiers.store.sessions
    try:
        submit(llm, "p0", A, session_id="parent")
        assert "parent" in sessions.paused
        child = submit(llm, "c0", OTHERS[0], session_id="child", parent_session_id="parent")
        assert child.output_token_ids == reference[tuple(OTHERS[0])]
        # the parent's pause (and the prefetch planned for it) is kept, and its think-time
        # predictor learned no gap from its subagent's start
        assert sessions.paused["parent"][1]
        p = sessions.predictors.get("parent")
        assert p is None or not p.gaps
        submit(llm, "p1", A, session_id="parent")  # the parent's real return
        assert len(sessions.predictors["parent"].gaps) == 1
        settle(llm)
    finally:
        llm.close()


def test_subagent_end_brings_parent_prefetch_forward(tmp_path, page_bytes, reference):
    llm = tiered_llm(tmp_path, page_bytes)
    core = llm.core
    conn = core.tiers
    host = conn.store.host
    keys = conn.keyspaces[0].keys(hash_chain(A, BS)[:6])

    def wait_for_host(seconds):
        deadline = time.monotonic() + seconds
        while not all(host.contains(keys)) and time.monotonic() < deadline:
            time.sleep(0.02)
            core.idle()
        return all(host.contains(keys))

    try:
        submit(llm, "p0", A, session_id="parent")  # one turn: no think time to predict from
        settle(llm)
        host.clear()  # the parent's pages drifted down to the disk
        submit(llm, "x", OTHERS[1])  # unrelated traffic brings nothing forward
        assert not wait_for_host(0.3)
        assert conn.store.counters["prefetches"] == 0
        submit(llm, "c0", OTHERS[0], session_id="child", parent_session_id="parent")
        assert wait_for_host(5), "the parent's pages were not brought up at its subagent's end"
        assert conn.store.counters["prefetches"] >= 1
    finally:
        llm.close()
