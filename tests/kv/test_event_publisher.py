"""The engine's KV event publisher (loomserve.kv.event_publisher) on real engines: the batches a
real ZMQ socket gets describe exactly what the pool (and the host tier) holds.

The replay socket gives every batch since seq 0 deterministically (a PUB subscriber misses what
was sent before it joined), so most checks read the stream through it; one test reads the live
PUB socket too."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest
import zmq

from loomserve import LLM, SamplingParams
from loomserve.kv import events as ev
from loomserve.kv.event_publisher import KVEventPublisher
from loomserve.kv.event_wire import (
    END_SEQ,
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    batch_decoder,
    seq_bytes,
    seq_of,
)
from loomserve.kv.hashing import hash_chain
from tests.execution.models.conftest import FIXTURES
from tests.kv.conftest import make_config
from tests.kv.connector.conftest import BS, OTHERS, POOL_BLOCKS, A, tiny_page_bytes

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
EVENTS = "tcp://127.0.0.1:0"


def replay_all(endpoint: str, start: int = 0, timeout: float = 10.0) -> list[tuple[int, object]]:
    """Every buffered (seq, KVEventBatch) from `start` on, through a DEALER as vLLM's clients
    ask: [b"", start] -> [b"", topic, seq, payload]... then the END_SEQ marker."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    dec = batch_decoder()
    out = []
    try:
        sock.send_multipart((b"", seq_bytes(start)))
        while True:
            assert sock.poll(int(timeout * 1000)), "no replay answer"
            _, topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((seq_of(seq), dec.decode(payload)))
    finally:
        sock.close()


def index_of(batches) -> dict[tuple[str, int], set[bytes]]:
    """What a consumer knows after applying the batches: (medium, group) -> hashes."""
    idx: dict[tuple[str, int], set[bytes]] = defaultdict(set)
    for _, b in batches:
        for e in b.events:
            if isinstance(e, AllBlocksCleared):
                idx.clear()
            elif isinstance(e, BlockStored):
                idx[(e.medium, e.group_idx)].update(e.block_hashes)
            else:
                idx[(e.medium, e.group_idx)].difference_update(e.block_hashes)
    return {k: v for k, v in idx.items() if v}


def pool_index(llm) -> dict[tuple[str, int], set[bytes]]:
    return {(MEDIUM_GPU, g): set(c) for g, c in enumerate(llm.core.kv.pool.cached) if c}


def events_of(batches, cls, medium=None):
    return [e for _, b in batches for e in b.events
            if isinstance(e, cls) and (medium is None or e.medium == medium)]


def flushed(llm) -> list:
    """All batches so far, once the publisher thread sent what the last step flushed."""
    llm.core.idle()
    pub = llm.core.events
    deadline = time.monotonic() + 10
    while pub.stats()["pending"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pub.stats()["pending"] == 0 and pub.stats()["failed"] == 0
    return replay_all(pub.replay_endpoint)


@pytest.fixture
def small():
    llm = LLM(str(FIXTURES / "tiny-llama"), dtype="float32", block_size=BS,
              kv_cache_memory=str(tiny_page_bytes() * POOL_BLOCKS), kv_events_endpoint=EVENTS)
    yield llm
    llm.close()


def test_ready_reports_bound_endpoints_and_batch_zero_clears(small):
    ready = small.core.ready()
    for ep in (ready.kv_events_endpoint, ready.kv_events_replay_endpoint):
        assert ep.startswith("tcp://127.0.0.1:") and not ep.endswith(":0")
    assert ready.kv_events_endpoint != ready.kv_events_replay_endpoint
    batches = flushed(small)
    assert [s for s, _ in batches] == [0]
    assert batches[0][1].events == [AllBlocksCleared()]


def test_stored_chain_matches_the_pool(small):
    out = small.generate(A, GREEDY)[0]
    assert out.token_ids
    batches = flushed(small)
    assert [s for s, _ in batches] == list(range(len(batches)))
    stored = events_of(batches, BlockStored)
    expected = hash_chain(A, BS)  # the prompt's full blocks (8 generated tokens fill none)
    assert [h for e in stored for h in e.block_hashes] == expected
    assert [t for e in stored for t in e.token_ids] == A[:len(expected) * BS]
    parent = None
    for e in stored:  # each event chains onto the previous one: parent of block k+1 is block k
        assert e.parent_block_hash == parent
        assert (e.block_size, e.medium, e.group_idx) == (BS, MEDIUM_GPU, 0)
        assert e.kv_cache_spec_kind == "full_attention" and e.kv_cache_spec_sliding_window is None
        assert len(e.token_ids) == BS * len(e.block_hashes)
        parent = e.block_hashes[-1]
    assert index_of(batches) == pool_index(small)


def test_evictions_are_block_removed(small):
    for p in [A, *OTHERS]:  # the pool holds about two prompts: A is pushed out
        small.generate(p, GREEDY)
    batches = flushed(small)
    removed = {h for e in events_of(batches, BlockRemoved, MEDIUM_GPU) for h in e.block_hashes}
    gone = set(hash_chain(A, BS)) - set(small.core.kv.pool.cached[0])
    assert gone and gone <= removed
    assert all(e.group_idx == 0 for e in events_of(batches, BlockRemoved))
    assert index_of(batches) == pool_index(small)  # a consumer's index equals the pool


def test_reset_prefix_cache_is_all_blocks_cleared(small):
    small.generate(A, GREEDY)
    assert small.core.kv.reset_prefix_cache()
    batches = flushed(small)
    assert batches[-1][1].events == [AllBlocksCleared()]
    assert index_of(batches) == {} == pool_index(small)


def test_live_pub_socket_gets_the_batches(small):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(small.core.ready().kv_events_endpoint)
    try:
        dec = batch_decoder()
        got: list[bytes] = []
        deadline = time.monotonic() + 20
        prompt = list(A)
        while not got and time.monotonic() < deadline:  # until the SUB has joined
            prompt[0] += 1  # a new prefix each time: a store event each time
            small.generate(prompt, GREEDY)
            while sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b""
                got += [h for e in dec.decode(payload).events if isinstance(e, BlockStored)
                        for h in e.block_hashes]
        assert got and set(got) <= {h for _, b in flushed(small)
                                    for e in b.events if isinstance(e, BlockStored)
                                    for h in e.block_hashes}
    finally:
        sub.close()


@pytest.mark.parametrize("model,want", [
    ("tiny-qwen3-next", {"full_attention", "mamba"}),  # Gated DeltaNet state groups
    ("tiny-gemma3", {"full_attention", "sliding_window"})])
def test_hybrid_groups_carry_index_and_kind(model, want):
    llm = LLM(str(FIXTURES / model), dtype="float32", device="cpu", block_size=4,
              kv_cache_memory="1MiB", kv_events_endpoint=EVENTS)
    try:
        prompt = list(range(3, 83))
        llm.generate(prompt, GREEDY)
        batches = flushed(llm)
        groups = llm.core.runner.kv_cache_config.groups
        kinds = {"full_attention": "full_attention", "sliding_window": "sliding_window",
                 "linear_state": "mamba"}
        seen = {}
        for e in events_of(batches, BlockStored):
            spec = groups[e.group_idx].spec
            assert e.kv_cache_spec_kind == kinds[spec.kind] and e.block_size == 4
            assert e.kv_cache_spec_sliding_window == getattr(spec, "sliding_window", None)
            n = len(e.token_ids)  # a state checkpoint has no token list
            assert n == 4 * len(e.block_hashes) if e.kv_cache_spec_kind != "mamba" else n == 0
            seen[e.group_idx] = e.kv_cache_spec_kind
        assert set(seen.values()) == want and len(seen) >= 2, seen
        assert index_of(batches) == pool_index(llm)  # per group
    finally:
        llm.close()


def test_host_tier_writes_are_medium_cpu():
    page = tiny_page_bytes()
    llm = LLM(str(FIXTURES / "tiny-llama"), dtype="float32", block_size=BS,
              kv_cache_memory=str(page * POOL_BLOCKS), host_cache_memory=str(page * 64),
              kv_events_endpoint=EVENTS)
    try:
        llm.generate(A, GREEDY)
        assert llm.core.tiers.store.flush(10)  # the tier writes run on worker threads
        batches = flushed(llm)
        cpu = events_of(batches, BlockStored, MEDIUM_CPU)
        assert cpu, "no host tier event"
        hashes = [h for e in cpu for h in e.block_hashes]
        assert set(hashes) <= set(hash_chain(A, BS))
        for e in cpu:
            assert (e.token_ids, e.parent_block_hash, e.ownership) == ([], None, "host")
            assert (e.group_idx, e.block_size) == (0, BS)
        keys = llm.core.tiers.keyspaces[0].keys(hashes)
        assert all(llm.core.tiers.store.tier("host").contains(keys))
        assert index_of(batches)[(MEDIUM_CPU, 0)] == set(hashes)
    finally:
        llm.close()


class StalledPublisher(KVEventPublisher):
    """Its thread waits in _send until released: the step outruns it."""

    def __init__(self, *a, **kw) -> None:
        self.release = threading.Event()
        super().__init__(*a, **kw)

    def _send(self, seq: int, payload: bytes) -> None:
        assert self.release.wait(10)
        super()._send(seq, payload)


def test_a_full_queue_drops_and_the_next_batch_clears():
    """The step never waits for the publisher: past the queue bound a batch is dropped, and the
    next one that gets through starts with AllBlocksCleared (consumers forget, never go wrong)."""
    pub = StalledPublisher(EVENTS, EVENTS, make_config(16), max_queue_batches=1)
    try:
        deadline = time.monotonic() + 10
        while pub._queue.qsize() and time.monotonic() < deadline:  # batch 0 is being sent
            time.sleep(0.005)

        def step(marker: int) -> None:
            pub.on_pool_event(ev.BlockStored([bytes([marker]) * 16], None, [], 4, 0))
            pub.flush()

        step(1)  # fills the queue
        step(2)  # dropped
        assert pub.stats()["dropped"] == 1
        pub.release.set()
        wait_until = time.monotonic() + 10
        while pub.stats()["pending"] and time.monotonic() < wait_until:
            time.sleep(0.005)
        step(3)
        while pub.stats()["pending"] and time.monotonic() < wait_until:
            time.sleep(0.005)
        batches = replay_all(pub.replay_endpoint)
        kinds = [[type(e).__name__ + (e.block_hashes[0][:1].hex() if e.block_hashes else "")
                  if isinstance(e, BlockStored) else type(e).__name__ for e in b.events]
                 for _, b in batches]
        assert kinds == [["AllBlocksCleared"], ["BlockStored01"],
                         ["AllBlocksCleared", "BlockStored03"]]
    finally:
        pub.release.set()
        pub.close()
