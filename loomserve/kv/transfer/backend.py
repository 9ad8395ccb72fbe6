"""KV transfer backends: one-sided reads of registered memory between engines.

A backend moves bytes, nothing else: the prefill side registers a host staging arena, the
decode side registers its receive buffer and reads (remote address -> local address) batches
from a peer named by its `session_id`. A small best-effort `notify` tells the prefill side that
a transfer was pulled so it can reuse the staging slots early (its expiry frees them anyway).

Backends:
- InProcTransfer: engines in one process (unit tests); a read is a memmove between buffers
  registered with the two engines; it can be told to fail after N bytes (a transfer that dies
  mid-way).
- MooncakeTransfer (mooncake.py): Mooncake Transfer Engine, TCP here, RDMA where present.

Invariants:
- `read` either copies every op completely or raises TransferFailed; after a failure the local
  destination may hold any mix of old and new bytes (callers check what they read).
- Only registered memory is read or written: an address outside every registered region of
  either side is a TransferFailed, never a stray copy.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from abc import ABC, abstractmethod

import torch


class TransferFailed(RuntimeError):
    """A read did not complete (peer gone, unregistered address, injected fault)."""


# (remote address, local address, bytes)
ReadOp = tuple[int, int, int]


class KVTransfer(ABC):
    """A transfer endpoint. `session_id` is what peers pass to `read`; `notify_address` is
    where peers send `notify` messages (None: the backend takes none)."""

    name = "transfer"
    session_id: str
    notify_address: str | None = None

    @abstractmethod
    def register(self, buf: torch.Tensor) -> None:
        """Make buf's memory (contiguous, CPU) readable/writable by transfers."""

    @abstractmethod
    def read(self, session: str, ops: list[ReadOp]) -> None:
        """Copy each op's bytes from the peer's registered memory into local registered
        memory; raises TransferFailed. Synchronous: callers bound it in time (see PeerTier)."""

    @abstractmethod
    def notify(self, address: str, message: bytes) -> None:
        """Best effort, never blocks, never raises: message reaches the peer's take_notifies()
        or is lost."""

    @abstractmethod
    def take_notifies(self) -> list[bytes]:
        """Messages peers sent since the last call."""

    def close(self) -> None:
        pass


class _Regions:
    """Registered (address, size) regions of one engine."""

    def __init__(self) -> None:
        self._regions: list[tuple[int, int, torch.Tensor]] = []
        self._lock = threading.Lock()

    def add(self, buf: torch.Tensor) -> None:
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("transfer buffers must be contiguous CPU tensors")
        with self._lock:
            self._regions.append((buf.data_ptr(), buf.numel() * buf.element_size(), buf))

    def covers(self, addr: int, n: int) -> bool:
        with self._lock:
            return any(a <= addr and addr + n <= a + size for a, size, _ in self._regions)


class InProcTransfer(KVTransfer):
    """Engines of one process: a read is a memmove between registered buffers.

    fail_after_bytes: the next reads copy that many bytes in all, then raise TransferFailed
    (the bytes before stay written: a transfer that dies mid-way). None: never fail."""

    name = "inproc"
    _engines: dict[str, "InProcTransfer"] = {}
    _ids = itertools.count(1)
    _lock = threading.Lock()

    def __init__(self) -> None:
        with InProcTransfer._lock:
            self.session_id = f"inproc:{next(InProcTransfer._ids)}"
            InProcTransfer._engines[self.session_id] = self
        self.notify_address = self.session_id
        self.regions = _Regions()
        self.fail_after_bytes: int | None = None
        self.bytes_read = 0
        self._notes: list[bytes] = []
        self._notes_lock = threading.Lock()

    def register(self, buf: torch.Tensor) -> None:
        self.regions.add(buf)

    def read(self, session: str, ops: list[ReadOp]) -> None:
        peer = InProcTransfer._engines.get(session)
        if peer is None:
            raise TransferFailed(f"no in-process transfer engine {session!r}")
        for raddr, laddr, n in ops:
            if not peer.regions.covers(raddr, n):
                raise TransferFailed(f"remote range {raddr:#x}+{n} is not registered")
            if not self.regions.covers(laddr, n):
                raise TransferFailed(f"local range {laddr:#x}+{n} is not registered")
        for raddr, laddr, n in ops:
            budget = self.fail_after_bytes
            if budget is not None and n > budget:
                if budget > 0:
                    ctypes.memmove(laddr, raddr, budget)
                    self.bytes_read += budget
                self.fail_after_bytes = 0
                raise TransferFailed("injected fault: the transfer failed mid-way")
            ctypes.memmove(laddr, raddr, n)
            self.bytes_read += n
            if budget is not None:
                self.fail_after_bytes = budget - n

    def notify(self, address: str, message: bytes) -> None:
        peer = InProcTransfer._engines.get(address)
        if peer is not None:
            with peer._notes_lock:
                peer._notes.append(bytes(message))

    def take_notifies(self) -> list[bytes]:
        with self._notes_lock:
            out, self._notes = self._notes, []
        return out

    def close(self) -> None:
        with InProcTransfer._lock:
            InProcTransfer._engines.pop(self.session_id, None)
