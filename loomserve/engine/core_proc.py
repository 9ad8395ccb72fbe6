"""The engine core's own process: build the core, then run the core loop over ZMQ.

The front end binds two IPC sockets (TCP for a DP core on another node, started by that node's
headless `serve`: loomserve.engine.dp_remote) and spawns this process (multiprocessing "spawn": no forked
torch or OpenMP state), which connects a PULL socket for CoreInput and a PUSH socket for
CoreEvent, both msgpack. The first event is CoreReady (or CoreFailed, and exit 1). Exit codes:
0 after a Shutdown or when the front end is gone (for a lockstep DP rank also when a peer that
left on the Shutdown made its collective fail: core_loop.CoreLoop.run), 1 after a core failure
(CoreDead sent first).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

import msgspec
import zmq

from loomserve.config import EngineConfig
from loomserve.config.log_lines import configure_child
from loomserve.engine import faults
from loomserve.engine.core_loop import CoreLoop
from loomserve.engine.messages import CoreFailed, CoreInput, Shutdown, input_decoder
from loomserve.execution.process import die_with_parent

log = logging.getLogger("loomserve.engine")


HEARTBEAT_MS = 1000  # TCP (a core on another node): ZMQ pings; a silent peer is gone after
HEARTBEAT_TIMEOUT_MS = 5000  # this long (a killed process is noticed at once: its socket closes)


def tcp_options(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


class ZmqTransport:
    """CoreTransport over a PULL (inputs) and a PUSH (events) socket. A parent that is gone
    (its pid no longer ours) reads as a Shutdown: the core never outlives its front end. Over
    TCP (`monitor` set: the inputs socket's connection events) a lost connection to the front
    end reads as a Shutdown too: the front end is gone or has declared this core dead."""

    def __init__(self, inputs: zmq.Socket, events: zmq.Socket, parent_pid: int,
                 monitor: zmq.Socket | None = None) -> None:
        self.inputs, self.events = inputs, events
        self.parent_pid = parent_pid
        self.monitor = monitor
        self._enc = msgspec.msgpack.Encoder()
        self._dec = input_decoder()

    def front_end_gone(self) -> bool:
        from zmq.utils.monitor import recv_monitor_message
        while self.monitor is not None and self.monitor.poll(0):
            if recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED:
                log.error("lost the connection to the front end: stopping")
                return True
        return False

    def recv(self, timeout: float) -> list[CoreInput]:
        if os.getppid() != self.parent_pid or self.front_end_gone():
            return [Shutdown()]
        if not self.inputs.poll(int(timeout * 1000)):
            return []
        out = []
        while True:
            try:
                out.append(self._dec.decode(self.inputs.recv(zmq.NOBLOCK, copy=False).buffer))
            except zmq.Again:
                return out

    def send(self, event) -> None:
        self.events.send(self._enc.encode(event))


def _pick_cuda_device(config: EngineConfig) -> None:
    """A single-rank DP core on CUDA takes its device from parallel.state.device_offset (as a
    multi-rank core's executor does for each rank); without DP, the current device."""
    pc = config.parallel
    if pc.data_parallel_size > 1 and pc.world_size == 1 and \
            config.model.torch_device.type == "cuda" and config.model.device in ("auto", "cuda"):
        import torch

        from loomserve.execution.parallel.state import device_offset
        torch.cuda.set_device(device_offset(pc) % torch.cuda.device_count())


def run_core_process(config: EngineConfig, input_addr: str, event_addr: str, parent_pid: int,
                     log_level: str = "INFO") -> None:
    """Process target: serve the front end at the two addresses until told to stop."""
    die_with_parent(parent_pid)
    pc = config.parallel  # a data-parallel core labels its lines with its DP rank
    label = f"core dp{pc.data_parallel_rank}" if pc.data_parallel_size > 1 else "core"
    configure_child(log_level, label)  # the front end's --log-format, inherited
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's to handle
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    events = ctx.socket(zmq.PUSH)
    remote = input_addr.startswith("tcp://")  # a DP core on a node other than the front end's
    for sock in (inputs, events):
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        if remote:
            tcp_options(sock)
    monitor = inputs.get_monitor_socket(zmq.EVENT_DISCONNECTED) if remote else None
    inputs.connect(input_addr)
    events.connect(event_addr)
    transport = ZmqTransport(inputs, events, parent_pid, monitor)
    code = 1
    try:
        try:
            _pick_cuda_device(config)
            from loomserve.engine.core import EngineCore
            core = EngineCore(config)
            faults.install(core)
            from loomserve.execution.parallel.dp_lockstep import maybe_lockstep
            core = maybe_lockstep(core, config)  # DEP: DP ranks step together (else core)
        except BaseException as exc:  # noqa: BLE001 - a failed start is reported, then exit 1
            log.error("the engine core could not start\n%s", traceback.format_exc())
            transport.send(CoreFailed(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
            return
        try:
            transport.send(core.ready())
            code = CoreLoop(core, transport).run()
        finally:
            try:
                core.close()
            except Exception:  # closing tiers after a failure may fail too: keep the exit code
                log.exception("closing the engine core failed")
    finally:
        events.close(linger=2000)  # deliver the last event (CoreDead) before exiting
        if monitor is not None:
            inputs.disable_monitor()
            monitor.close(linger=0)
        inputs.close(linger=0)
        ctx.term()
        sys.exit(code)
