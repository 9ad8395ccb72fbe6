"""Data parallelism over nodes: engine cores on nodes other than the front end's.

Node 0 runs the front end (`loomserve serve`, DPCoreClient) with its own D/N cores as local
processes; node k > 0 runs `loomserve serve --node-rank k` with the same flags, which starts
its D/N cores headless (`run_headless_dp`). Each remote core connects a PULL (inputs) and a
PUSH (events) socket to the two TCP ports node 0 binds for it at master_addr
(ParallelConfig.remote_core_ports), so the front end talks to every core with the same msgpack
messages whatever node it is on. RemoteCoreClient is ProcCoreClient's counterpart for such a
core: it has no process to watch, so it watches the connection (ZMQ socket monitor plus ZMQ
heartbeats: a killed core is noticed at once, a node that drops off the network within
HEARTBEAT_TIMEOUT_MS). Invariants: a core whose connection breaks is dead to the front end (its
CoreDead is reported once) and the core stops itself on the same break (core_proc); a node's
launcher exits when any of its cores exits, stopping the others (a DEP group cannot go on
without one of its ranks), so a node never serves half a job.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from loomserve.config import EngineConfig
from loomserve.engine.core_client import DEATH_POLL_S, EngineStartError, ZmqCoreClient
from loomserve.engine.core_proc import HEARTBEAT_TIMEOUT_MS, tcp_options
from loomserve.engine.dp_rank import rank_config
from loomserve.engine.messages import (
    CoreDead,
    CoreEvent,
    CoreFailed,
    CoreReady,
    Shutdown,
    event_decoder,
)

log = logging.getLogger("loomserve.engine")

SHUTDOWN_GRACE_S = 5.0
REMOTE_START_TIMEOUT_S = float(os.environ.get("LOOMSERVE_REMOTE_START_TIMEOUT_S", "900"))


def bind_host(addr: str) -> str:
    """ZMQ binds to an interface address, not a name: master_addr resolved."""
    return socket.gethostbyname(addr)


class RemoteCoreClient(ZmqCoreClient):
    """DP core `dp_rank` on another node, over the two TCP sockets node 0 binds for it."""

    def __init__(self, config: EngineConfig, dp_rank: int,
                 on_event: Callable[[CoreEvent], None]) -> None:
        pc = config.parallel
        self.dp_rank, self.node = dp_rank, dp_rank // pc.dp_local_size
        self._on_event = on_event
        self._ctx = zmq.Context()
        host = bind_host(pc.master_addr)
        in_port, ev_port = pc.remote_core_ports(dp_rank)
        self._inputs = self._socket(zmq.PUSH, f"tcp://{host}:{in_port}")
        self._events = self._socket(zmq.PULL, f"tcp://{host}:{ev_port}")
        self._monitor = self._events.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._send_lock = threading.Lock()
        self._enc = msgspec.msgpack.Encoder()
        self._dec = event_decoder()
        self._connected = False
        self._gone = False  # the core's connection broke (or we closed it)
        self._closing = False

    def _socket(self, kind: int, addr: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        tcp_options(sock)
        sock.bind(addr)
        return sock

    def _watch(self) -> None:
        """Connection events so far: accepted -> connected; disconnected after that -> gone."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_ACCEPTED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self._gone = True

    def wait_ready(self) -> CoreReady:
        """Block until the core on node `self.node` has connected and loaded its model."""
        deadline, said = time.monotonic() + REMOTE_START_TIMEOUT_S, time.monotonic()
        while True:
            if self._events.poll(int(DEATH_POLL_S * 1000)):
                first = self._dec.decode(self._events.recv())
                break
            self._watch()
            if self._gone:
                first = CoreFailed(f"the core on node {self.node} disconnected before it was ready")
                break
            if time.monotonic() > deadline:
                first = CoreFailed(f"no core connected from node {self.node} within "
                                   f"{REMOTE_START_TIMEOUT_S:.0f} s (start `loomserve serve "
                                   f"--node-rank {self.node}` there)")
                break
            if time.monotonic() - said > 30:
                said = time.monotonic()
                log.info("waiting for data-parallel rank %d (node %d) to connect and load",
                         self.dp_rank, self.node)
        if not isinstance(first, CoreReady):
            self._close()
            raise EngineStartError(first.error if isinstance(first, (CoreFailed, CoreDead))
                                   else f"unexpected first event {type(first).__name__}")
        self.ready = first
        self._thread = threading.Thread(target=self._receive, name="loomserve-remote-core",
                                        daemon=True)
        self._thread.start()
        return first

    def _peer_alive(self) -> bool:
        return not self._gone and not self._closing

    def _check_peer(self) -> None:
        self._watch()

    def _death(self) -> str:
        return f"lost the connection to the core on node {self.node}"

    def is_alive(self) -> bool:
        return not self._gone and not self._closing

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` for the core to disconnect (after a Shutdown)."""
        deadline = time.monotonic() + timeout
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(DEATH_POLL_S)

    def shutdown(self) -> None:
        if self._closing:
            return
        self.submit(Shutdown())
        self.join(5.0)
        self._close()

    def _close(self, kill: bool = False) -> None:
        """Close the sockets: a core still connected sees the break and stops itself."""
        if self._ctx.closed:
            return
        self._closing = True
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * DEATH_POLL_S + 1)
        self._events.disable_monitor()
        for sock in (self._monitor, self._inputs, self._events):
            sock.close(linger=0)
        self._ctx.term()


def run_headless_dp(config: EngineConfig, log_level: str = "INFO") -> int:
    """Node k > 0 of a multi-node DP deployment: run this node's engine cores, connected to
    the front end on node 0, until one exits; then stop the rest. Exit code: the worst."""
    from loomserve.engine.core_proc import run_core_process
    pc = config.parallel
    addr = pc.master_addr
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for r in pc.dp_node_ranks():
        in_port, ev_port = pc.remote_core_ports(r)
        procs.append(ctx.Process(target=run_core_process, name=f"loomserve-core-dp{r}", args=(
            rank_config(config, r), f"tcp://{addr}:{in_port}", f"tcp://{addr}:{ev_port}",
            os.getpid(), log_level)))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    for p in procs:
        p.start()
    log.info("node %d: data-parallel ranks %s connecting to %s (heartbeat timeout %d ms)",
             pc.node_rank, list(pc.dp_node_ranks()), addr, HEARTBEAT_TIMEOUT_MS)
    while not stop.is_set() and all(p.is_alive() for p in procs):
        stop.wait(DEATH_POLL_S)
    # One core gone (or told to stop): the rest cannot serve alone. After a front end's
    # Shutdown they are leaving too, so they get a grace period before the signal.
    deadline = time.monotonic() + (0 if stop.is_set() else SHUTDOWN_GRACE_S)
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs if not p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    bad = [c for c in codes if c]
    return (1 if bad else 0) if not stop.is_set() else 0
