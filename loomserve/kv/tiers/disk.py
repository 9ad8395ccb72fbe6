"""Local disk tier: one file per page under a directory, bounded total size, LRU.

A file is `<root>/<last byte of key, hex>/<key hex>.page`, holding the codec record (32-byte
header with length, xxh3 checksum and key digest, then the page). The last byte shards: every
key of one model starts with the same layout fingerprint, while its last byte comes from the
block hash, so the files spread evenly over 256 directories. Writes go to a temporary file
in the same directory, are fsynced, then renamed over the final name, so a reader sees either
no file or a whole one. A crash can still leave a short or garbled file (a disk without
ordered writes, a file edited by hand): every load checks length and checksum, and a file that
fails is a miss and is deleted.

The LRU index lives in memory and is rebuilt from the directory at start (oldest mtime first),
so pages survive an engine restart. The size bound counts whole records.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from loomserve.kv.tiers import codec
from loomserve.kv.tiers.base import (
    PagesRemoved,
    PagesStored,
    Tier,
    TierUnavailable,
    copy_page,
    cpu_row,
    rows_list,
)

_SUFFIX = ".page"


class DiskTier(Tier):
    name = "disk"
    index_in_memory = True

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, page_bytes: int,
                 fsync: bool = True, name: str | None = None) -> None:
        super().__init__(page_bytes, name)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.record_bytes = codec.HEADER_BYTES + page_bytes
        self.max_files = capacity_bytes // self.record_bytes
        if self.max_files < 1:
            raise ValueError(f"disk tier of {capacity_bytes} bytes holds no page")
        self.fsync = fsync
        self._index: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self._tmp_seq = 0
        self._scan()

    # -- files ----------------------------------------------------------------------------
    def path_of(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[-2:] / (h + _SUFFIX)

    def _scan(self) -> None:
        found = []
        for sub in self.root.iterdir() if self.root.exists() else ():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                if f.name.endswith(".tmp"):
                    f.unlink(missing_ok=True)  # an interrupted write
                    continue
                if not f.name.endswith(_SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(f.name[:-len(_SUFFIX)])
                    st = f.stat()
                except (ValueError, OSError):
                    continue
                if st.st_size != self.record_bytes:
                    f.unlink(missing_ok=True)  # another layout's page or a torn file
                    continue
                found.append((st.st_mtime_ns, key))
        found.sort()
        for _, key in found:
            self._index[key] = None
        self._evict_over(0)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        return len(self._index) * self.record_bytes

    # -- interface --------------------------------------------------------------------------
    def contains(self, keys) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    def get_into(self, keys, out: torch.Tensor, rows=None) -> list[bool]:
        self._check_page(out)
        rows = rows_list(rows, len(keys))
        t0 = time.perf_counter()
        ok = [False] * len(keys)
        bad: list[bytes] = []
        pb = self.page_bytes
        staging = None
        for i, k in enumerate(keys):
            with self._lock:
                if k not in self._index:
                    continue
                self._index.move_to_end(k)
            dst = out[rows[i]]
            direct = dst.device.type == "cpu" and dst.is_contiguous()
            if not direct:
                if staging is None:
                    staging = torch.empty(pb, dtype=torch.uint8)
                dst_buf = staging
            else:
                dst_buf = dst
            try:
                with open(self.path_of(k), "rb", buffering=0) as f:
                    header = f.read(codec.HEADER_BYTES)
                    payload = dst_buf.numpy().reshape(-1)
                    n = f.readinto(payload)
                    extra = f.read(1)
                if n != pb or extra:
                    raise codec.CorruptRecord(f"file length {codec.HEADER_BYTES + n}+")
                codec.check(k, header, payload, pb)
            except FileNotFoundError:
                with self._lock:
                    self._index.pop(k, None)
                continue
            except (codec.CorruptRecord, OSError):
                # The row may hold garbage now; it is reported False so nobody reads it.
                bad.append(k)
                continue
            if not direct:
                copy_page(dst, staging)
            ok[i] = True
        if bad:
            self._drop(bad)
        hits = sum(ok)
        self.stats.add(hits=hits, misses=len(keys) - hits, corrupt=len(bad),
                       bytes_read=hits * pb)
        self.stats.observe("get", time.perf_counter() - t0)
        return ok

    def put(self, keys, src: torch.Tensor, rows=None) -> list[bool]:
        self._check_page(src)
        rows = rows_list(rows, len(keys))
        t0 = time.perf_counter()
        stored = []
        fails = 0
        for i, k in enumerate(keys):
            with self._lock:
                if k in self._index:
                    self._index.move_to_end(k)
                    continue
            row = cpu_row(src, rows[i])
            payload = memoryview(row.numpy())
            try:
                self._write_file(k, codec.pack_header(k, payload), payload)
            except OSError:
                fails += 1
                continue
            with self._lock:
                self._index[k] = None
            stored.append(k)
        evicted = self._evict_over(0)
        self.stats.add(stores=len(stored), store_fails=fails, evictions=len(evicted),
                       bytes_written=len(stored) * self.page_bytes)
        self.stats.observe("put", time.perf_counter() - t0)
        if evicted:
            self._emit(PagesRemoved(self.name, evicted))
        if stored:
            self._emit(PagesStored(self.name, stored))
        if fails == len(keys) and keys:
            raise TierUnavailable(f"{self.name}: cannot write under {self.root}")
        ok = set(stored)
        with self._lock:
            return [k in ok or k in self._index for k in keys]

    def _write_file(self, key: bytes, header: bytes, payload) -> None:
        path = self.path_of(key)
        path.parent.mkdir(exist_ok=True)
        with self._lock:
            self._tmp_seq += 1
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{self._tmp_seq}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, header)
            view = memoryview(payload).cast("B")
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)

    def _evict_over(self, extra: int) -> list[bytes]:
        victims = []
        with self._lock:
            while len(self._index) + extra > self.max_files:
                k, _ = self._index.popitem(last=False)
                victims.append(k)
        for k in victims:
            self.path_of(k).unlink(missing_ok=True)
        return victims

    def _drop(self, keys: list[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._index.pop(k, None)
        for k in keys:
            self.path_of(k).unlink(missing_ok=True)
        self._emit(PagesRemoved(self.name, keys, "corrupt"))

    def touch(self, keys) -> None:
        with self._lock:
            for k in keys:
                if k in self._index:
                    self._index.move_to_end(k)

    def remove(self, keys) -> None:
        removed = []
        with self._lock:
            for k in keys:
                if self._index.pop(k, "x") is None:
                    removed.append(k)
        for k in removed:
            self.path_of(k).unlink(missing_ok=True)
        if removed:
            self._emit(PagesRemoved(self.name, removed, "removed"))

    def clear(self) -> None:
        with self._lock:
            keys = list(self._index)
            self._index.clear()
        for k in keys:
            self.path_of(k).unlink(missing_ok=True)
        if keys:
            self._emit(PagesRemoved(self.name, keys, "removed"))
