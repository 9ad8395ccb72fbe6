"""Host-memory tier: one preallocated buffer of page slots, LRU over keys.

The buffer is pinned when CUDA is present (so device<->host copies can run asynchronously and
at full PCIe/NVLink-C2C speed) and plain memory otherwise. It is allocated once: a put never
allocates, it takes a free slot or evicts the least recently used key.

Like the other tiers, every page is checksummed (xxh3_64, codec.checksum): put records the sum
of the slot it wrote, get_into recomputes it before copying the slot out. A page that fails (a
stray write, a bit flip in memory without ECC) is dropped: a miss and a PagesRemoved "corrupt"
event, never data.

Device pages move on a copy stream of the tier's own (one per device), not the compute stream,
so a tier copy overlaps the next step's kernels instead of queueing behind them; a put first
waits for the work already queued on the device's default stream (the step that wrote the
pages), and both directions synchronize the copy stream before the lock is released.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from typing import Sequence

import torch

from loomserve.kv.tiers import codec
from loomserve.kv.tiers.base import PagesRemoved, PagesStored, Tier, copy_page, rows_list


class HostTier(Tier):
    name = "host"
    local = True
    index_in_memory = True

    def __init__(self, capacity_bytes: int, page_bytes: int, pin_memory: bool | None = None,
                 name: str | None = None) -> None:
        super().__init__(page_bytes, name)
        self.num_slots = capacity_bytes // page_bytes
        if self.num_slots < 1:
            raise ValueError(f"host tier of {capacity_bytes} bytes holds no {page_bytes}-byte page")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.pinned = bool(pin_memory)
        self.buffer = torch.empty((self.num_slots, page_bytes), dtype=torch.uint8,
                                  pin_memory=self.pinned)
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # LRU order: front is oldest
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._sums = [0] * self.num_slots  # codec.checksum of the page in each used slot
        # Copies happen under the lock: a slot being read must not be evicted and rewritten.
        self._lock = threading.Lock()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _copy_stream(self, device: torch.device):
        """The tier's copy stream on a CUDA device (None for a CPU tensor). Called under the
        lock."""
        if device.type != "cuda":
            return None
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.page_bytes

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        t0 = time.perf_counter()
        with self._lock:
            out = [k in self._slots for k in keys]
        self.stats.observe("contains", time.perf_counter() - t0)
        return out

    def get_into(self, keys, out: torch.Tensor, rows=None) -> list[bool]:
        self._check_page(out)
        rows = rows_list(rows, len(keys))
        t0 = time.perf_counter()
        ok = [False] * len(keys)
        hits = 0
        bad: list[bytes] = []
        non_blocking = self.pinned and out.device.type == "cuda"
        with self._lock:
            slots = self._slots
            buf = self.buffer
            sums = self._sums
            stream = self._copy_stream(out.device)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for i, k in enumerate(keys):
                    s = slots.get(k)
                    if s is None:
                        continue
                    if codec.checksum(buf[s].numpy()) != sums[s]:
                        del slots[k]
                        self._free.append(s)
                        bad.append(k)
                        continue
                    slots.move_to_end(k)
                    copy_page(out[rows[i]], buf[s], non_blocking)
                    ok[i] = True
                    hits += 1
            if stream is not None:
                # Before the lock is released (the slots may be rewritten right after) and
                # before the step that reads these pages is queued.
                stream.synchronize()
        self.stats.add(hits=hits, misses=len(keys) - hits, corrupt=len(bad),
                       bytes_read=hits * self.page_bytes)
        self.stats.observe("get", time.perf_counter() - t0)
        if bad:
            self._emit(PagesRemoved(self.name, bad, "corrupt"))
        return ok

    def put(self, keys, src: torch.Tensor, rows=None) -> list[bool]:
        self._check_page(src)
        rows = rows_list(rows, len(keys))
        t0 = time.perf_counter()
        stored: list[bytes] = []
        evicted: list[bytes] = []
        with self._lock:
            slots = self._slots
            buf = self.buffer
            written: list[int] = []
            stream = self._copy_stream(src.device)
            if stream is not None:  # the pages' writes, queued before this call, come first
                stream.wait_stream(torch.cuda.default_stream(src.device))
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for i, k in enumerate(keys):
                    if k in slots:
                        slots.move_to_end(k)
                        continue
                    if self._free:
                        s = self._free.pop()
                    else:
                        old, s = slots.popitem(last=False)
                        evicted.append(old)
                    copy_page(buf[s], src[rows[i]], self.pinned and stream is not None)
                    slots[k] = s
                    written.append(s)
                    stored.append(k)
            if stream is not None:
                stream.synchronize()
            for s in written:  # after the copies landed
                self._sums[s] = codec.checksum(buf[s].numpy())
        self.stats.add(stores=len(stored), evictions=len(evicted),
                       bytes_written=len(stored) * self.page_bytes)
        self.stats.observe("put", time.perf_counter() - t0)
        if evicted:
            self._emit(PagesRemoved(self.name, evicted))
        if stored:
            self._emit(PagesStored(self.name, stored))
        return [True] * len(keys)

    def touch(self, keys) -> None:
        with self._lock:
            for k in keys:
                if k in self._slots:
                    self._slots.move_to_end(k)

    def remove(self, keys) -> None:
        removed = []
        with self._lock:
            for k in keys:
                s = self._slots.pop(k, None)
                if s is not None:
                    self._free.append(s)
                    removed.append(k)
        if removed:
            self._emit(PagesRemoved(self.name, removed, "removed"))

    def clear(self) -> None:
        with self._lock:
            keys = list(self._slots)
            self._slots.clear()
            self._free = list(range(self.num_slots - 1, -1, -1))
        if keys:
            self._emit(PagesRemoved(self.name, keys, "removed"))

    def lru_keys(self) -> list[bytes]:
        with self._lock:
            return list(self._slots)
