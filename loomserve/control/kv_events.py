"""Subscribing to an instance's KV events (vLLM's ZMQ wire format, loomserve.kv.event_wire).

KVEventSubscriber hands its consumer every batch exactly once, in sequence order, on its own
thread. The stream is a PUB socket, so batches can be missed (a slow joiner, a full queue, a
reconnect); sequence numbers make that visible:
- a gap (seq past the next expected one) is filled from the publisher's replay socket before
  anything later is applied; live copies of the replayed batches are then skipped;
- a gap the replay cannot cover (its buffer rolled over, no replay socket, no answer within
  the timeout), or a batch that does not decode, calls on_reset ("forget everything about this
  instance") and the stream goes on from there;
- a restarted publisher (its sequence went backwards, or after a reconnection the replay
  socket no longer holds the last batch applied, byte for byte) means on_reset, then the new
  stream is followed from its start (replayed from 0 when its first batches were missed).
A fresh subscriber starts by replaying from seq 0, so joining late gives the instance's history
when the buffer still holds it (batch 0 of a loomserve publisher is AllBlocksCleared), and an
on_reset first when it does not.

`python -m loomserve.control.kv_events ENDPOINT` prints the decoded batches as JSON lines;
ENDPOINT is a ZMQ address or an instance's http://host:port (its /info names the sockets).
Imports no engine internals: only the wire format.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from typing import Callable

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from loomserve.kv.event_wire import END_SEQ, KVEventBatch, batch_decoder, seq_bytes, seq_of

log = logging.getLogger("loomserve.control.kv_events")
POLL_MS = 100  # the thread's wait on its sockets: bounds close() and the replay deadline check


class KVEventSubscriber:
    """Follows one instance's KV event stream (see the module docstring for the guarantees).

    on_batch and on_reset run on the subscriber's thread; an exception in either is logged and
    the stream goes on. stats(): received (live batches applied), replayed (batches applied
    from the replay socket), gaps, resets, duplicates (live copies skipped), last_seq.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None,
                 on_batch: Callable[[KVEventBatch], None], on_reset: Callable[[], None],
                 topic: str = "", name: str = "", replay_timeout: float = 2.0) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.on_batch = on_batch
        self.on_reset = on_reset
        self.topic = topic.encode()
        self.name = name or endpoint
        self.replay_timeout = replay_timeout
        self._decoder = batch_decoder()
        self._next = 0  # the seq the consumer needs next
        self._dup_after: int | None = None  # after a replay: live seqs in (this, _next) are copies
        self._counts = dict(received=0, replayed=0, gaps=0, resets=0, duplicates=0)
        self._last_seq = -1
        self._last_payload = b""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx = zmq.Context.instance()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kv-events-{self.name}")
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0 + POLL_MS / 1000)

    def stats(self) -> dict:
        return {**self._counts, "last_seq": self._last_seq}

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        # Connection events: each (re)connection is checked against the replay socket, since a
        # restarted publisher's stream could otherwise pass for the old one's continuation.
        mon = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(POLL_MS))
                if mon in ready:
                    recv_monitor_message(mon)
                    self._resync()
                if sub not in ready:
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("%s: ignoring a message of %d frames", self.name, len(frames))
                    continue
                topic, seq, payload = frames
                if self.topic and topic != self.topic:
                    continue  # ZMQ filters by prefix; the topic must match exactly
                self._on_live(seq_of(seq), payload)
        except Exception:
            log.exception("%s: KV event subscriber failed", self.name)
        finally:
            sub.disable_monitor()
            mon.close()
            sub.close()

    def _on_live(self, seq: int, payload: bytes) -> None:
        if self._dup_after is not None:
            if self._dup_after < seq < self._next:
                self._counts["duplicates"] += 1
                return
            self._dup_after = None
        if seq < self._next:  # went backwards: a new publisher; its stream starts at 0
            log.info("%s: sequence went back from %d to %d (publisher restarted)", self.name,
                     self._next - 1, seq)
            self._reset()
            self._next = 0
        if seq > self._next:
            self._fill_gap(seq, payload)
        else:
            self._apply(seq, payload, "received")

    def _resync(self) -> None:
        """The SUB socket (re)connected. First time: catch up. Later: ask the replay socket for
        the last batch applied; the same bytes mean the same publisher (catch up from there),
        other bytes or none mean a restart (reset, then follow the new stream from 0)."""
        if self._last_seq < 0:
            self._catch_up()
            return
        got = self._replay(self._last_seq)
        if got is None:
            return  # cannot tell: the sequence checks still catch a restart that goes back
        if got[:1] == [(self._last_seq, self._last_payload)]:
            self._catch_up(got[1:])
            return
        log.info("%s: reconnected to a different publisher (restarted): reset", self.name)
        self._reset()
        self._next = 0
        self._last_seq = -1
        self._catch_up()

    def _catch_up(self, got: list[tuple[int, bytes]] | None = None) -> None:
        """Apply the replay buffer from _next now rather than at the next live batch (an idle
        instance may send none for long). Live batches sent meanwhile wait in the SUB socket;
        their copies of replayed ones are skipped."""
        if got is None:
            got = self._replay(self._next)
        got = self._replay(self._next)
        if not got:
            return
        if got[0][0] != self._next:
            self._reset()  # the history is gone: what follows is all the consumer will know
            self._next = got[0][0]
        for s, p in got:
            if s == self._next:
                self._apply(s, p, "replayed")
        self._dup_after = -1

    def _fill_gap(self, seq: int, payload: bytes) -> None:
        """Batches [_next, seq) were missed: replay them (and seq, which the replay repeats)."""
        self._counts["gaps"] += 1
        got = self._replay(self._next)
        if not got or got[0][0] != self._next:
            log.info("%s: batches %d..%d missed and not replayable: reset", self.name,
                     self._next, seq - 1)
            self._reset()
            got = [g for g in got or () if g[0] <= seq]
            if not got or got[-1][0] < seq:
                got = [(seq, payload)]  # the live batch is the new starting point
            self._next = got[0][0]
        for s, p in got:
            if s == self._next:  # a well-formed replay is contiguous; anything else is skipped
                self._apply(s, p, "replayed")
        if self._next <= seq:  # the replay stopped short of the live batch (a restart raced)
            self._reset()
            self._apply(seq, payload, "received")
            return
        self._dup_after = seq

    def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Every buffered batch from `start` on, or None (no replay socket, or the answer
        stalled: replay_timeout without a frame, so a long replay that keeps coming is waited
        for). A fresh DEALER per request, so a late answer to an abandoned request can never be
        read as the answer to a later one."""
        if not self.replay_endpoint:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        out = []
        try:
            sock.send_multipart((b"", seq_bytes(start)))
            deadline = time.monotonic() + self.replay_timeout
            while time.monotonic() < deadline and not self._stop.is_set():
                if not sock.poll(POLL_MS):
                    continue
                frames = sock.recv_multipart()
                deadline = time.monotonic() + self.replay_timeout
                if len(frames) != 4 or len(frames[2]) != 8:
                    continue
                _, topic, seq, payload = frames
                if seq == END_SEQ:
                    return out
                if not self.topic or topic == self.topic:
                    out.append((seq_of(seq), payload))
            log.warning("%s: replay from %s stalled for %.1f s", self.name,
                        self.replay_endpoint, self.replay_timeout)
            return None
        finally:
            sock.close()

    def _apply(self, seq: int, payload: bytes, kind: str) -> None:
        self._next = seq + 1
        self._last_seq = seq
        self._last_payload = payload
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError as e:
            log.warning("%s: batch %d does not decode (%s): reset", self.name, seq, e)
            self._reset()
            return
        self._counts[kind] += 1
        try:
            self.on_batch(batch)
        except Exception:
            log.exception("%s: on_batch failed on batch %d", self.name, seq)

    def _reset(self) -> None:
        self._counts["resets"] += 1
        self._dup_after = None
        try:
            self.on_reset()
        except Exception:
            log.exception("%s: on_reset failed", self.name)


_WILDCARD = re.compile(r"^(\w+://)(\*|0\.0\.0\.0|\[::\]|::)(:\d+)$")


def reachable(endpoint: str | None, host: str) -> str | None:
    """An endpoint bound on a wildcard address, as reached at `host` (the host whose /info
    reported it); any other endpoint unchanged."""
    if endpoint is None:
        return None
    m = _WILDCARD.match(endpoint)
    return f"{m.group(1)}{host}{m.group(3)}" if m else endpoint


def endpoints_from_info(info: dict, host: str) -> tuple[str, str | None, str] | None:
    """(endpoint, replay_endpoint, topic) from an instance's GET /info, or None when the
    instance publishes no KV events."""
    ev = info.get("kv_events")
    if not ev:
        return None
    return (reachable(ev["endpoint"], host), reachable(ev.get("replay_endpoint"), host),
            ev.get("topic") or "")


def _hex(h):
    return h.hex() if isinstance(h, bytes) else h


def _event_json(event) -> dict:
    """An event as plain JSON: its fields, "type" its class, hashes in hex."""
    d = msgspec.to_builtins(event)
    if "block_hashes" in d:
        d["block_hashes"] = [_hex(h) for h in event.block_hashes]
    if "parent_block_hash" in d:
        d["parent_block_hash"] = _hex(event.parent_block_hash)
    return d


def _resolve(target: str, replay: str | None, topic: str) -> tuple[str, str | None, str]:
    """A ZMQ address as given, or an instance's http(s)://host:port through its /info."""
    if not target.startswith(("http://", "https://")):
        return target, replay, topic
    import urllib.parse
    import urllib.request
    with urllib.request.urlopen(target.rstrip("/") + "/info", timeout=10) as r:
        info = json.load(r)
    found = endpoints_from_info(info, urllib.parse.urlparse(target).hostname or "127.0.0.1")
    if found is None:
        raise SystemExit(f"{target} publishes no KV events (start it with --kv-events-endpoint)")
    return found


def main(argv: list[str] | None = None) -> None:
    import argparse
    p = argparse.ArgumentParser(prog="python -m loomserve.control.kv_events",
                                description="Print an instance's KV event batches as JSON lines")
    p.add_argument("endpoint", help="ZMQ PUB address (tcp://host:port) or http://host:port of "
                   "an instance (its /info names the sockets)")
    p.add_argument("--replay", help="replay ROUTER address (default: the PUB port + 1)")
    p.add_argument("--topic", default="")
    p.add_argument("--seconds", type=float, default=0, help="stop after this long (0: never)")
    a = p.parse_args(argv)
    replay = a.replay
    if replay is None and a.endpoint.startswith("tcp://"):
        base, port = a.endpoint.rsplit(":", 1)
        replay = f"{base}:{int(port) + 1}"
    endpoint, replay, topic = _resolve(a.endpoint, replay, a.topic)
    endpoint, replay = reachable(endpoint, "127.0.0.1"), reachable(replay, "127.0.0.1")

    def on_batch(batch: KVEventBatch) -> None:
        line = {"seq": sub.stats()["last_seq"], "ts": batch.ts,
                "events": [_event_json(e) for e in batch.events]}
        print(json.dumps(line), flush=True)

    def on_reset() -> None:
        print(json.dumps({"reset": True}), flush=True)

    sub = KVEventSubscriber(endpoint, replay, on_batch, on_reset, topic)
    sub.start()
    try:
        deadline = time.monotonic() + a.seconds if a.seconds else None
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()


if __name__ == "__main__":
    main()
