"""MooncakeTransfer: KV transfers over the Mooncake Transfer Engine (TCP here, RDMA where the
NICs have it), peers found by P2P handshake (no metadata server).

The engine's `session_id` is "host:rpc_port" (the port the Transfer Engine picked); a read is one
`batch_transfer_sync_read` of all its ops. Release notices ride a ZMQ PUSH/PULL pair beside the
engine: the PULL socket binds tcp://host:* when the backend starts, and its bound address is the
`notify_address` a prefill instance hands out in its kv_transfer_params.

Invariants:
- Only registered memory moves; an address outside the peer's registered buffers is refused by
  the peer (a TransferFailed here, never a stray copy).
- notify never blocks: a full or unreachable peer drops the message (the prefill side's expiry
  frees its slots anyway).
"""

from __future__ import annotations

import os
import threading

import torch
import zmq

from loomserve.kv.transfer.backend import KVTransfer, ReadOp, TransferFailed


def import_engine():
    """The TransferEngine class, or ImportError saying what to install."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # also raised when libibverbs1 is missing
        raise ImportError(
            "the Mooncake Transfer Engine is not importable: pip install "
            "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA); it "
            f"needs the system library libibverbs1 even for TCP. Cause: {e}") from e
    return TransferEngine


class MooncakeTransfer(KVTransfer):
    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        engine_cls = import_engine()
        self.host = host
        self.engine = engine_cls()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise RuntimeError(f"Mooncake Transfer Engine failed to start on {host} (rc {rc})")
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self._ctx = zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 10_000)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.notify_address = f"tcp://{host}:{port}"
        self._push: dict[str, zmq.Socket] = {}
        self._lock = threading.Lock()  # ZMQ sockets are not thread-safe
        self._buffers: list[torch.Tensor] = []  # registered memory stays alive with the engine

    def register(self, buf: torch.Tensor) -> None:
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("transfer buffers must be contiguous CPU tensors")
        rc = self.engine.register_memory(buf.data_ptr(), buf.numel() * buf.element_size())
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory failed (rc {rc})")
        self._buffers.append(buf)

    def read(self, session: str, ops: list[ReadOp]) -> None:
        if not ops:
            return
        remote = [r for r, _, _ in ops]
        local = [loc for _, loc, _ in ops]
        sizes = [n for _, _, n in ops]
        rc = self.engine.batch_transfer_sync_read(session, local, remote, sizes)
        if rc != 0:
            raise TransferFailed(f"Mooncake read from {session} failed (rc {rc})")

    def notify(self, address: str, message: bytes) -> None:
        with self._lock:
            sock = self._push.get(address)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 1000)
                try:
                    sock.connect(address)
                except zmq.ZMQError:
                    sock.close()
                    return
                self._push[address] = sock
            try:
                sock.send(message, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # not connected (yet) or full: the peer's expiry frees the slots

    def take_notifies(self) -> list[bytes]:
        out = []
        with self._lock:
            while True:
                try:
                    out.append(self._pull.recv(zmq.NOBLOCK))
                except zmq.Again:
                    return out

    def close(self) -> None:
        with self._lock:
            for s in self._push.values():
                s.close()
            self._push.clear()
            self._pull.close()
