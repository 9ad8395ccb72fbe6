"""KVEventSubscriber (loomserve.control.kv_events) against a real publisher over real ZMQ
sockets: the consumer sees every batch exactly once, in order, whether it joined late or lost
batches on the way (filled from the replay socket); a gap the replay buffer no longer covers and
a publisher restart make it forget the instance (on_reset) and follow the stream from there.

Each batch carries a marker (a one-block BlockStored whose hash encodes a counter), so the
consumer's view is a list of markers and resets that the assertions compare with what was sent.
"""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from loomserve.control.kv_events import KVEventSubscriber, endpoints_from_info, reachable
from loomserve.kv import events as ev
from loomserve.kv.event_publisher import KVEventPublisher
from loomserve.kv.event_wire import AllBlocksCleared, BlockStored
from tests.kv.conftest import make_config

RESET = "reset"
CLEARED = "cleared"


class DroppingPublisher(KVEventPublisher):
    """Keeps chosen batches off the PUB socket (they stay in the replay buffer): a subscriber
    that lost them on the way."""

    drop: set[int] = set()

    def _send(self, seq: int, payload: bytes) -> None:
        if seq not in self.drop:
            super()._send(seq, payload)


def publisher(cls=KVEventPublisher, endpoint="tcp://127.0.0.1:0", replay="tcp://127.0.0.1:0",
              **kw) -> KVEventPublisher:
    return cls(endpoint, replay, make_config(16), **kw)


def publish(pub: KVEventPublisher, marker: int) -> None:
    pub.on_pool_event(ev.BlockStored([marker.to_bytes(16, "big")], None, [], 4, 0))
    pub.flush()


class Consumer:
    """Records markers, clears and resets in the order the subscriber delivered them."""

    def __init__(self) -> None:
        self.seen: list = []
        self.lock = threading.Lock()

    def on_batch(self, batch) -> None:
        with self.lock:
            for e in batch.events:
                if isinstance(e, AllBlocksCleared):
                    self.seen.append(CLEARED)
                elif isinstance(e, BlockStored):
                    self.seen.append(int.from_bytes(e.block_hashes[0], "big"))

    def on_reset(self) -> None:
        with self.lock:
            self.seen.append(RESET)

    def markers(self) -> list[int]:
        with self.lock:
            return [m for m in self.seen if isinstance(m, int)]

    def subscriber(self, pub: KVEventPublisher, **kw) -> KVEventSubscriber:
        sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint, self.on_batch, self.on_reset,
                                pub.topic, **kw)
        sub.start()
        return sub


def feed_until(pub, consumer: Consumer, first: int, until, timeout: float = 20.0) -> int:
    """Publish markers first, first+1, ... every 20 ms until until() holds; the next marker."""
    deadline = time.monotonic() + timeout
    m = first
    while not until():
        assert time.monotonic() < deadline, consumer.seen[-20:]
        publish(pub, m)
        m += 1
        time.sleep(0.02)
    return m


def settled(pub: KVEventPublisher) -> int:
    """The seq the next batch will get, once the thread sent everything handed to it."""
    deadline = time.monotonic() + 10
    while pub.stats()["pending"] and time.monotonic() < deadline:
        time.sleep(0.005)
    return pub.stats()["published"]


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.fixture
def consumer():
    return Consumer()


def test_late_subscriber_replays_the_history(consumer):
    pub = publisher()
    for m in range(5):  # sent before anyone listens: only the replay socket still has them
        publish(pub, m)
    settled(pub)
    sub = consumer.subscriber(pub)
    try:
        feed_until(pub, consumer, 5, lambda: len(consumer.markers()) >= 10)
        seen = consumer.seen
        assert seen[0] == CLEARED and RESET not in seen
        assert consumer.markers() == list(range(len(consumer.markers())))
        s = sub.stats()
        assert s["replayed"] >= 6 and s["resets"] == 0
    finally:
        sub.close()
        pub.close()


def test_lost_batches_are_filled_from_replay_in_order(consumer):
    pub = publisher(DroppingPublisher)
    sub = consumer.subscriber(pub)
    try:
        m = feed_until(pub, consumer, 0, lambda: len(consumer.markers()) >= 3)
        wait_for(lambda: consumer.markers() and consumer.markers()[-1] == m - 1)
        gaps = sub.stats()["gaps"]
        nxt = settled(pub)
        pub.drop = {nxt, nxt + 1}  # the next two batches never reach the PUB socket
        for k in range(3):
            publish(pub, m + k)
        wait_for(lambda: consumer.markers()[-1:] == [m + 2])
        assert consumer.markers() == list(range(m + 3))  # each once, in order
        s = sub.stats()
        assert s["gaps"] == gaps + 1 and s["resets"] == 0 and s["last_seq"] == nxt + 2
        assert RESET not in consumer.seen
    finally:
        sub.close()
        pub.close()


def test_gap_past_the_replay_buffer_resets(consumer):
    pub = publisher(buffer_steps=3)
    for m in range(10):
        publish(pub, m)
    settled(pub)
    sub = consumer.subscriber(pub)
    try:
        last = feed_until(pub, consumer, 10, lambda: len(consumer.markers()) >= 3) - 1
        wait_for(lambda: consumer.markers()[-1] == last)
        seen = consumer.seen
        assert seen[0] == RESET and seen.count(RESET) == 1 and CLEARED not in seen
        got = consumer.markers()
        assert got == list(range(got[0], last + 1)) and got[0] > 0  # history lost, no hole
        assert sub.stats()["resets"] == 1
    finally:
        sub.close()
        pub.close()


@pytest.mark.parametrize("before,burst", [(20, 0), (3, 12)], ids=["seq-back", "seq-ahead"])
def test_publisher_restart_resets_and_follows_the_new_stream(consumer, before, burst):
    """seq-ahead: the new publisher is past the old one's last seq before the subscriber
    reconnects, so only the replay check on reconnection can tell it is another stream."""
    pub = publisher()
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    sub = consumer.subscriber(pub)
    try:
        feed_until(pub, consumer, 0, lambda: len(consumer.markers()) >= before)
        pub.close()
        pub = None
        deadline = time.monotonic() + 10
        while pub is None:  # the old sockets release their ports asynchronously
            try:
                pub = publisher(endpoint=endpoint, replay=replay)
            except ValueError:
                assert time.monotonic() < deadline, "ports not released"
                time.sleep(0.05)
        for m in range(1000, 1000 + burst):
            publish(pub, m)
        feed_until(pub, consumer, 1000 + burst, lambda: 1003 + burst in consumer.markers())
        seen = consumer.seen
        after = seen[seen.index(RESET) + 1:]
        assert after[0] == CLEARED  # the new instance's batch 0, replayed
        assert [m for m in after if m != CLEARED] == list(range(1000, 1000 + len(after) - 1))
        assert sub.stats()["resets"] == 1
    finally:
        sub.close()
        if pub is not None:
            pub.close()


def test_topic_filters_exactly(consumer):
    """ZMQ matches topics by prefix: the subscriber must still drop "kv-other" for "kv"."""
    pub = publisher(topic="kv")
    other = publisher(topic="kv-other")
    subs = [KVEventSubscriber(p.endpoint, p.replay_endpoint, consumer.on_batch,
                              consumer.on_reset, "kv") for p in (pub, other)]
    for s in subs:
        s.start()
    try:
        for m in range(1000, 1020):
            publish(other, m)
        feed_until(pub, consumer, 0, lambda: len(consumer.markers()) >= 3)
        for m in range(1020, 1040):
            publish(other, m)
        time.sleep(0.3)
        assert consumer.markers() == list(range(len(consumer.markers())))
        assert subs[1].stats()["received"] == subs[1].stats()["gaps"] == 0
    finally:
        for s in subs:
            s.close()
        pub.close()
        other.close()


def test_close_joins_quickly_and_stats_shape(consumer):
    sub = KVEventSubscriber("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", consumer.on_batch,
                            consumer.on_reset)
    sub.start()
    t0 = time.monotonic()
    sub.close()
    assert time.monotonic() - t0 < 1.5
    assert set(sub.stats()) == {"received", "replayed", "gaps", "resets", "duplicates",
                                "last_seq"}


def test_wildcard_endpoints_become_the_info_host():
    assert reachable("tcp://*:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"
    assert reachable("tcp://0.0.0.0:5558", "h") == "tcp://h:5558"
    assert reachable("tcp://127.0.0.1:5557", "h") == "tcp://127.0.0.1:5557"
    info = {"kv_events": {"endpoint": "tcp://*:1", "replay_endpoint": "tcp://*:2", "topic": "t"}}
    assert endpoints_from_info(info, "a") == ("tcp://a:1", "tcp://a:2", "t")
    assert endpoints_from_info({"kv_events": None}, "a") is None


def test_replay_socket_answers_a_raw_dealer():
    """vLLM's clients speak to the ROUTER as [b"", start]: the answer is
    [b"", topic, seq, payload]... then [b"", b"", END_SEQ, b""]."""
    from loomserve.kv.event_wire import END_SEQ, seq_bytes, seq_of
    pub = publisher(topic="t")
    for m in range(3):
        publish(pub, m)
    settled(pub)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pub.replay_endpoint)
    try:
        sock.send_multipart((b"", seq_bytes(2)))
        frames = []
        while True:
            assert sock.poll(5000)
            f = sock.recv_multipart()
            frames.append(f)
            if f[2] == END_SEQ:
                break
        assert [seq_of(f[2]) for f in frames[:-1]] == [2, 3]
        assert all(f[:2] == [b"", b"t"] for f in frames[:-1])
        assert frames[-1] == [b"", b"", END_SEQ, b""]
    finally:
        sock.close()
        pub.close()


def test_a_silent_replay_socket_resets_and_the_stream_goes_on(consumer):
    """The replay socket takes requests but never answers (a wedged publisher thread): after
    replay_timeout the gap counts as lost (on_reset) and live batches are applied from there."""
    pub = publisher(replay=None)
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:0")
    for m in range(5):
        publish(pub, m)
    settled(pub)
    sub = KVEventSubscriber(pub.endpoint, silent.getsockopt_string(zmq.LAST_ENDPOINT),
                            consumer.on_batch, consumer.on_reset, replay_timeout=0.3)
    sub.start()
    try:
        last = feed_until(pub, consumer, 5, lambda: len(consumer.markers()) >= 3) - 1
        wait_for(lambda: consumer.markers()[-1] == last)
        assert consumer.seen[0] == RESET and consumer.seen.count(RESET) == 1
        got = consumer.markers()
        assert got == list(range(got[0], last + 1)) and got[0] >= 5
        assert silent.poll(0)  # it was asked
    finally:
        sub.close()
        pub.close()
        silent.close()
