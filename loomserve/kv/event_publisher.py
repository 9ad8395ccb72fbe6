"""Publishes the engine's KV events over ZMQ in vLLM's wire format (loomserve.kv.event_wire).

Lives in the engine core's process. The pool calls `on_pool_event` synchronously on the core
thread; the tiers call `on_tier_event` from their worker threads. Both only append to a list:
at the end of each engine step (and in idle housekeeping) `flush()` hands what was collected
to a background thread as one batch. That thread converts it to wire events, encodes it once,
PUBs (topic, 8-byte seq, payload), keeps the last `buffer_steps` (seq, payload) pairs and
answers replay requests on a ROUTER socket exactly as vLLM's ZmqEventPublisher does.

Invariants:
- Sequence numbers start at 0 and grow by one per published batch; batch 0 is always
  [AllBlocksCleared] (a fresh instance's cache is empty), so a consumer replaying from 0 after
  a restart learns that it must forget the old instance.
- The step never blocks on the publisher: a full hand-off queue drops the batch, counts it,
  and the next batch that gets through starts with AllBlocksCleared, so a consumer forgets
  what it can no longer trust instead of keeping a wrong index.
- Events keep the pool's order within a batch; tier events follow the pool's in the batch
  they were flushed with (they describe copies of blocks the pool already reported).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from loomserve.kv import event_wire as wire
from loomserve.kv import events as ev
from loomserve.kv.spec import KVCacheConfig, SlidingWindowSpec
from loomserve.kv.tiers.base import PagesRemoved

log = logging.getLogger("loomserve.kv.events")

# vLLM's KVCacheSpecKind values: consumers classify groups by these names. A recurrent-state
# group (Gated DeltaNet, Mamba2) is vLLM's "mamba" kind.
_SPEC_KIND = {"full_attention": "full_attention", "sliding_window": "sliding_window",
              "linear_state": "mamba"}
QUEUE_BATCHES = 10_000  # batches waiting for the thread before the step starts dropping
POLL_S = 0.05  # the thread's wait for work: bounds replay latency and close time


class WireConverter:
    """In-process pool and tier events -> vLLM wire events, for one KV cache layout."""

    def __init__(self, kv_config: KVCacheConfig) -> None:
        self.groups: list[tuple[int, str, int | None]] = []
        for g in kv_config.groups:
            spec = g.spec
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            # (block_size, vLLM's spec kind, window): what every BlockStored of the group says
            self.groups.append((spec.block_size, _SPEC_KIND.get(spec.kind, "unknown"), window))
        self.fingerprints: dict[bytes, int] = {}  # tier key prefix -> group index
        self.fp_len = 0
        self.media: dict[str, str] = {}  # tier name -> MEDIUM_CPU | MEDIUM_STORAGE

    def watch_tiers(self, keyspaces, tiers) -> None:
        """Learn the tier key prefixes (one KeySpace per group) and each tier's medium."""
        self.fingerprints = {ks.fingerprint: g for g, ks in enumerate(keyspaces)}
        self.fp_len = len(keyspaces[0].fingerprint) if keyspaces else 0
        self.media = {t.name: wire.MEDIUM_CPU if t.local else wire.MEDIUM_STORAGE for t in tiers}

    def pool_event(self, e) -> wire.KVCacheEvent:
        if isinstance(e, ev.BlockStored):
            bs, kind, window = self.groups[e.group_id]
            return wire.BlockStored(
                block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash,
                token_ids=e.token_ids, block_size=e.block_size or bs, lora_id=None,
                medium=wire.MEDIUM_GPU, lora_name=None, group_idx=e.group_id,
                kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)
        if isinstance(e, ev.BlockRemoved):
            return wire.BlockRemoved(block_hashes=e.block_hashes, medium=wire.MEDIUM_GPU,
                                     group_idx=e.group_id)
        return wire.AllBlocksCleared()

    def tier_events(self, e) -> list[wire.KVCacheEvent]:
        """One wire event per group the keys belong to; keys of another layout (a shared
        pool's foreign pages) are skipped. Tier copies carry no tokens and no parent: the
        consumer learned both from the device event of the same hash."""
        by_group: dict[int, list[bytes]] = {}
        n = self.fp_len
        for key in e.keys:
            g = self.fingerprints.get(key[:n])
            if g is not None:
                by_group.setdefault(g, []).append(key[n:])
        medium = self.media.get(e.tier, wire.MEDIUM_STORAGE)
        out: list[wire.KVCacheEvent] = []
        for g, hashes in by_group.items():
            if isinstance(e, PagesRemoved):
                out.append(wire.BlockRemoved(block_hashes=hashes, medium=medium, group_idx=g,
                                             ownership=e.tier))
                continue
            bs, kind, window = self.groups[g]
            out.append(wire.BlockStored(
                block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=bs,
                lora_id=None, medium=medium, lora_name=None, group_idx=g,
                kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
                ownership=e.tier))
        return out


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind and return the bound address (a port 0 resolved to the port the OS chose)."""
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class KVEventPublisher:
    """PUB + replay ROUTER sockets and the thread that owns them (see the module docstring).

    The sockets are bound in the constructor, so `endpoint` / `replay_endpoint` are the bound
    addresses once it returns (what CoreReady reports); after that only the thread uses them.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None, kv_config: KVCacheConfig,
                 topic: str = "", buffer_steps: int = 10_000,
                 max_queue_batches: int = QUEUE_BATCHES) -> None:
        self.converter = WireConverter(kv_config)
        self.topic = topic
        self._topic = topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 500)  # close: give the last batches a moment to leave
        self._replay = None
        try:
            self.endpoint = bind(self._pub, endpoint)
            self.replay_endpoint = None
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # A full replay plus its end marker must fit, whatever the subscriber's pace.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = bind(self._replay, replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"KV events: cannot bind {endpoint} / {replay_endpoint}: {e}"
                             ) from e
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_batches)
        self._pool_events: list = [ev.AllBlocksCleared()]  # batch 0: an empty cache
        self._tier_events: list = []
        self._tier_lock = threading.Lock()
        self._lost = False
        self._closed = False
        self.handed = 0  # batches queued to the thread
        self.published = 0
        self.failed = 0  # batches the thread could not encode or send
        self.dropped = 0
        self.replays = 0
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher",
                                        daemon=True)
        self._thread.start()
        self.flush()

    # -- the engine's side (core thread; on_tier_event: any thread) --------------------------
    def on_pool_event(self, event: ev.KVCacheEvent) -> None:
        self._pool_events.append(event)

    def on_tier_event(self, event) -> None:
        with self._tier_lock:
            self._tier_events.append(event)

    def watch_tiers(self, connector) -> None:
        """Publish a TierConnector's tier events too (medium CPU / STORAGE)."""
        self.converter.watch_tiers(connector.keyspaces, connector.store.tiers)
        connector.store.subscribe(self.on_tier_event)

    def flush(self) -> None:
        """Hand what this step collected to the thread as one batch; never blocks."""
        with self._tier_lock:
            tier, self._tier_events = self._tier_events, []
        pool = self._pool_events
        if not pool and not tier or self._closed:
            return
        self._pool_events = []
        if self._lost:
            pool.insert(0, ev.AllBlocksCleared())
        self.handed += 1  # before the put: the thread may publish it at once
        try:
            self._queue.put_nowait((time.time(), pool, tier))
            self._lost = False
        except queue.Full:
            self.handed -= 1
            self.dropped += 1
            self._lost = True
            if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, ...: a slow log, not a flood
                log.warning("KV events: publisher queue full, %d batches dropped; the next "
                            "batch starts with AllBlocksCleared", self.dropped)

    def stats(self) -> dict:
        """pending: batches handed to the thread and not yet sent (nor failed)."""
        return {"published": self.published, "dropped": self.dropped, "failed": self.failed,
                "replays": self.replays,
                "pending": self.handed - self.published - self.failed}

    def close(self, timeout: float = 1.0) -> None:
        """Publish what is pending, stop the thread (joined within `timeout`), close sockets."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass  # the thread also stops on _closed once the queue is empty
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("KV events: publisher thread did not stop within %.1f s", timeout)

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        seq = 0
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    item = self._queue.get(timeout=POLL_S)
                except queue.Empty:
                    if self._closed:
                        break
                    continue
                if item is None:
                    break
                try:
                    payload = enc.encode(self._batch(*item))
                    self._send(seq, payload)
                except Exception:  # a bad event must not kill the stream: drop it, say so
                    log.exception("KV events: could not publish batch %d", seq)
                    self.failed += 1
                    self._lost = True
                    continue
                self._buffer.append((seq, payload))
                seq += 1
                self.published += 1
        finally:
            self._close_sockets()

    def _send(self, seq: int, payload: bytes) -> None:
        """PUB one batch (a seam: tests drop chosen batches here to make gaps)."""
        self._pub.send_multipart((self._topic, wire.seq_bytes(seq), payload))

    def _batch(self, ts: float, pool: list, tier: list) -> wire.KVEventBatch:
        conv = self.converter
        events = [conv.pool_event(e) for e in pool]
        for e in tier:
            events += conv.tier_events(e)
        return wire.KVEventBatch(ts=ts, events=events)

    def _serve_replay(self) -> None:
        """Answer one request [client, b"", start_seq]: every buffered batch from start_seq on
        as [client, b"", topic, seq, payload], then [client, b"", b"", END_SEQ, b""]."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: invalid replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = wire.seq_of(start)
        self.replays += 1
        for s, payload in self._buffer:
            if s >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, wire.seq_bytes(s),
                                             payload))
        self._replay.send_multipart((client, b"", b"", wire.END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
