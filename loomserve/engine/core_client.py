"""The front end's handle on the engine core: in its own process (the default) or in a thread.

Both run the same CoreLoop; they differ only in transport. A client is built with an
`on_event(CoreEvent)` callback, called from a background thread of the front end for every
event after CoreReady; `ready` is the CoreReady once wait_ready() returned (EngineStartError
if the core could not start). Invariant: after a CoreDead (sent by the core, or made up by the client when
the core process vanished), on_event is never called again.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable

import msgspec
import zmq

from loomserve.config import EngineConfig
from loomserve.engine.messages import (
    CoreDead,
    CoreEvent,
    CoreFailed,
    CoreInput,
    CoreReady,
    Shutdown,
    event_decoder,
)

log = logging.getLogger("loomserve.engine")

DEATH_POLL_S = 0.1  # how often the receiver checks that the core process is alive
SHUTDOWN_TIMEOUT_S = 10.0


class EngineStartError(RuntimeError):
    """The core could not start (its message says why: a bad model path, a pool too small)."""


class ThreadCoreClient:
    """The core in a thread of this process (`--engine-in-process`): one GIL for both, but one
    process to debug. `core` is the EngineCore itself."""

    def __init__(self, config: EngineConfig, on_event: Callable[[CoreEvent], None]) -> None:
        self._inputs: queue.SimpleQueue = queue.SimpleQueue()
        self._on_event = on_event
        self._first: queue.SimpleQueue = queue.SimpleQueue()
        # The core is built on the thread that runs it: on a CPU every thread running parallel
        # torch ops gets its own OpenMP team, and with two teams libgomp throttles spin-waiting
        # (a decode step measured 30% slower).
        self._thread = threading.Thread(target=self._main, args=(config,),
                                        name="loomserve-core", daemon=True)
        self._thread.start()
        first = self._first.get()
        if isinstance(first, CoreFailed):
            self._thread.join()
            raise EngineStartError(first.error)
        self.ready: CoreReady = first

    def wait_ready(self) -> CoreReady:
        return self.ready

    def _main(self, config: EngineConfig) -> None:
        from loomserve.engine import faults
        from loomserve.engine.core import EngineCore
        from loomserve.engine.core_loop import CoreLoop
        try:
            self.core = EngineCore(config)
            faults.install(self.core)
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            log.exception("the engine core could not start")
            self._first.put(CoreFailed(f"{type(exc).__name__}: {exc}"))
            return
        self._first.put(self.core.ready())
        try:
            CoreLoop(self.core, self).run()
        finally:
            self.core.close()

    # CoreTransport, on the core's thread
    def recv(self, timeout: float) -> list[CoreInput]:
        out = []
        try:
            out.append(self._inputs.get(timeout=timeout) if timeout > 0
                       else self._inputs.get_nowait())
            while True:
                out.append(self._inputs.get_nowait())
        except queue.Empty:
            return out

    def send(self, event: CoreEvent) -> None:
        self._on_event(event)

    # front end side
    def submit(self, msg: CoreInput) -> None:
        self._inputs.put(msg)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._inputs.put(Shutdown())
        self._thread.join(timeout=SHUTDOWN_TIMEOUT_S)


class ZmqCoreClient:
    """What every core reached over ZMQ shares: a receiver thread that forwards events and
    reports the core dead once when its peer is gone, and a submit that never blocks on a dead
    core. Subclasses open `_inputs` / `_events` and say whether the peer lives (`_peer_alive`,
    cheap and thread-safe), refresh that view on the receiver thread (`_check_peer`) and why it
    died (`_death`)."""

    _closing = False

    def _peer_alive(self) -> bool:
        raise NotImplementedError

    def _check_peer(self) -> None:
        """Receiver thread only, between events."""

    def _death(self) -> str:
        raise NotImplementedError

    def _receive(self) -> None:
        events, dec = self._events, self._dec
        # a recv that times out, not poll() + recv(): zmq's Socket.poll builds a Poller per
        # call, ~50 us of the API process's CPU per streamed token
        events.setsockopt(zmq.RCVTIMEO, int(DEATH_POLL_S * 1000))
        while not self._closing:
            try:
                frame = events.recv(copy=False)
            except zmq.Again:
                frame = None
            if frame is not None:
                event = dec.decode(frame.buffer)
                self._on_event(event)
                if isinstance(event, CoreDead):
                    return
                continue
            self._check_peer()
            if not self._peer_alive() and not self._closing:
                self._drain()
                if not self._closing:
                    self._on_event(CoreDead(self._death()))
                return

    def _drain(self) -> None:
        """Events the core sent before it went (its CoreDead, if it got that far)."""
        while self._events.poll(0):
            event = self._dec.decode(self._events.recv())
            self._on_event(event)
            if isinstance(event, CoreDead):
                self._closing = True  # already reported: no made-up CoreDead after it

    def submit(self, msg: CoreInput) -> None:
        """Queue msg for the core; dropped once the core is gone (its death is reported by
        the receiver). PUSH blocks without a connected peer, so never block."""
        data = self._enc.encode(msg)
        with self._send_lock:
            while True:
                try:
                    self._inputs.send(data, zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    if not self._peer_alive():
                        return
                    self._inputs.poll(int(DEATH_POLL_S * 1000), zmq.POLLOUT)


class ProcCoreClient(ZmqCoreClient):
    """The core in its own process, over two IPC sockets (see loomserve.engine.core_proc).
    The constructor starts the process; wait_ready() waits for the model. A receiver thread
    then decodes events and notices a dead core process within DEATH_POLL_S."""

    def __init__(self, config: EngineConfig, on_event: Callable[[CoreEvent], None],
                 log_level: str = "INFO") -> None:
        from loomserve.engine.core_proc import run_core_process
        self._on_event = on_event
        self._dir = tempfile.mkdtemp(prefix="loomserve-")
        self._ctx = zmq.Context()
        self._inputs = self._socket(zmq.PUSH, f"ipc://{self._dir}/inputs")
        self._events = self._socket(zmq.PULL, f"ipc://{self._dir}/events")
        self._send_lock = threading.Lock()
        self._enc = msgspec.msgpack.Encoder()
        self._dec = event_decoder()
        self._closing = False
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_core_process, name="loomserve-core", daemon=True,
            args=(config, f"ipc://{self._dir}/inputs", f"ipc://{self._dir}/events", os.getpid(),
                  log_level))
        self.proc.start()

    def wait_ready(self) -> CoreReady:
        """Block until the core has loaded the model (the front end may do its own start-up
        work meanwhile); EngineStartError if it could not."""
        first = self._wait_first()
        if not isinstance(first, CoreReady):
            self._close(kill=True)
            raise EngineStartError(first.error if isinstance(first, (CoreFailed, CoreDead))
                                   else f"unexpected first event {type(first).__name__}")
        self.ready = first
        self._thread = threading.Thread(target=self._receive, name="loomserve-core-events",
                                        daemon=True)
        self._thread.start()
        return first

    def _socket(self, kind: int, addr: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a busy core
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(addr)
        return sock

    def _wait_first(self) -> CoreEvent:
        while True:  # model loading takes as long as it takes; a dead process ends the wait
            if self._events.poll(int(DEATH_POLL_S * 1000)):
                return self._dec.decode(self._events.recv())
            if not self.proc.is_alive():
                return CoreFailed(f"the engine core process exited with code "
                                  f"{self.proc.exitcode} before it was ready")

    def _peer_alive(self) -> bool:
        return self.proc.is_alive()

    def _death(self) -> str:
        return f"the engine core process exited with code {self.proc.exitcode}"

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def join(self, timeout: float) -> None:
        self.proc.join(timeout=timeout)

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self.proc.is_alive():
            try:
                self.submit(Shutdown())
            except zmq.ZMQError:
                pass
        self.proc.join(timeout=SHUTDOWN_TIMEOUT_S)
        self._close(kill=self.proc.is_alive())

    def _close(self, kill: bool) -> None:
        self._closing = True
        if kill and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=2)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * DEATH_POLL_S + 1)
        self._inputs.close(linger=0)
        self._events.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

