"""Shared distributed pool on Mooncake Store (TCP), the engine as a pure requester.

A `mooncake_master` keeps the metadata and a standalone `mooncake_client` owns the pool's
memory (see `loomserve store`); the engine connects with `global_segment_size=0`, so it only
reads and writes, and an engine restart loses nothing. Pages move zero-copy through two
registered staging buffers (reads, writes), one codec record (header + page) per object.
Deployment, staging and Mooncake's return codes: docs/design/tiers.md.

Invariants:
- A loaded record's length and checksum are checked in staging before a byte reaches the
  caller's buffer.
- A staging buffer a failed transfer may still write into is retired, never reused.
- Misses and refused puts are not faults; a call where every key faults raises TierUnavailable.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import torch

from loomserve.kv.tiers import codec
from loomserve.kv.tiers.base import PagesRemoved, Tier, TierUnavailable, copy_page, rows_list

OBJECT_NOT_FOUND = -704
_MISS = {OBJECT_NOT_FOUND, -703, -707}
_PUT_REFUSED = {-200, -1700}
_ALREADY_EXISTS = -705
_UNSAFE = {-800, -901}  # the transfer may still be in flight: retire the staging buffer


def import_store():
    """The MooncakeDistributedStore class, or ImportError saying what to install."""
    # Its INFO lines would flood the engine's stderr; warnings and errors still show.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    # setup() against a dead master retries for about 90 s by default; once takes ~4 s.
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:  # also raised when libibverbs1 is missing
        raise ImportError(
            "Mooncake Store is not importable: pip install mooncake-transfer-engine-non-cuda "
            "(CPU) or mooncake-transfer-engine (CUDA); it needs the system library libibverbs1 "
            f"(apt-get install libibverbs1) even for TCP. Cause: {e}") from e
    return MooncakeDistributedStore


class _Staging:
    def __init__(self, pages: int, record_bytes: int) -> None:
        self.buf = torch.empty((pages, record_bytes), dtype=torch.uint8)
        self.lock = threading.Lock()
        self.registered = False

    @property
    def ptr(self) -> int:
        return self.buf.data_ptr()


class MooncakeTier(Tier):
    name = "mooncake"

    def __init__(self, master_address: str, page_bytes: int, local_hostname: str = "127.0.0.1",
                 protocol: str = "tcp", staging_pages: int = 16, key_prefix: str = "ls/",
                 metadata_server: str = "P2PHANDSHAKE", local_buffer_bytes: int = 16 << 20,
                 name: str | None = None) -> None:
        super().__init__(page_bytes, name)
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
        self._cls = import_store()
        self.master_address = master_address
        self.local_hostname = local_hostname
        self.protocol = protocol
        self.metadata_server = metadata_server
        self.local_buffer_bytes = local_buffer_bytes
        self.key_prefix = key_prefix
        self.record_bytes = codec.HEADER_BYTES + page_bytes
        self.staging_pages = staging_pages
        self._read = _Staging(staging_pages, self.record_bytes)
        self._write = _Staging(staging_pages, self.record_bytes)
        self._retired: list[_Staging] = []
        self._conn_lock = threading.Lock()
        self._store = None
        try:
            self._connect()
        except TierUnavailable:
            pass  # connect lazily: the first operation retries

    # -- connection ---------------------------------------------------------------------------
    def _connect(self):
        with self._conn_lock:
            if self._store is not None:
                return self._store
            self._probe_master()
            store = self._cls()
            rc = store.setup(self.local_hostname, self.metadata_server, 0,
                             self.local_buffer_bytes, self.protocol, "", self.master_address)
            if rc != 0:
                try:
                    store.close()
                except Exception:
                    pass
                raise TierUnavailable(f"{self.name}: setup with master {self.master_address} "
                                      f"failed ({rc})")
            for st in (self._read, self._write):
                st.registered = False
                self._register(store, st)
            self._store = store
            return store

    def _probe_master(self, timeout_s: float = 0.5) -> None:
        """Fail fast when nothing listens at the master's address (setup would block)."""
        host, _, port = self.master_address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                pass
        except (OSError, ValueError) as e:
            raise TierUnavailable(f"{self.name}: master {self.master_address} unreachable: "
                                  f"{e}") from e

    def _register(self, store, st: _Staging) -> None:
        rc = store.register_buffer(st.ptr, st.buf.numel())
        if rc != 0:
            raise TierUnavailable(f"{self.name}: register_buffer failed ({rc})")
        st.registered = True

    def _retire(self, which: str) -> None:
        """Replace a staging buffer a failed transfer may still write into."""
        old = getattr(self, which)
        self._retired.append(old)
        del self._retired[:-8]  # transfers abandoned 8 failures ago have long finished
        new = _Staging(self.staging_pages, self.record_bytes)
        store = self._store
        if store is not None:
            try:
                self._register(store, new)
            except TierUnavailable:
                pass
        setattr(self, which, new)

    def _key(self, key: bytes) -> str:
        return self.key_prefix + key.hex()

    def close(self) -> None:
        with self._conn_lock:
            store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception:
                pass

    # -- interface ----------------------------------------------------------------------------
    def contains(self, keys) -> list[bool]:
        if not keys:
            return []
        store = self._connect()
        t0 = time.perf_counter()
        rc = store.batch_is_exist([self._key(k) for k in keys])
        self.stats.observe("contains", time.perf_counter() - t0)
        if all(r < 0 for r in rc):
            self.stats.add(errors=len(keys))
            raise TierUnavailable(f"{self.name}: is_exist failed ({rc[0]})")
        return [r == 1 for r in rc]

    def get_into(self, keys, out: torch.Tensor, rows=None) -> list[bool]:
        self._check_page(out)
        rows = rows_list(rows, len(keys))
        store = self._connect()
        ok = [False] * len(keys)
        faults = corrupt = 0
        rec, pb, hdr = self.record_bytes, self.page_bytes, codec.HEADER_BYTES
        t0 = time.perf_counter()
        for lo in range(0, len(keys), self.staging_pages):
            chunk = keys[lo:lo + self.staging_pages]
            unsafe = False
            st = self._read
            with st.lock:
                if not st.registered:
                    self._register(store, st)
                base = st.ptr
                rc = store.batch_get_into([self._key(k) for k in chunk],
                                          [base + j * rec for j in range(len(chunk))],
                                          [rec] * len(chunk))
                for j, r in enumerate(rc):
                    if r == rec:
                        record = st.buf[j]
                        try:
                            codec.check(chunk[j], record[:hdr].numpy(), record[hdr:].numpy(), pb)
                        except codec.CorruptRecord:
                            corrupt += 1
                            continue
                        copy_page(out[rows[lo + j]], record[hdr:])
                        ok[lo + j] = True
                    elif r >= 0:
                        corrupt += 1  # an object of another size under our key
                    elif r not in _MISS:
                        faults += 1
                        unsafe = unsafe or r in _UNSAFE
            if unsafe:
                self._retire("_read")
        hits = sum(ok)
        self.stats.add(hits=hits, misses=len(keys) - hits, errors=faults, corrupt=corrupt,
                       bytes_read=hits * pb)
        self.stats.observe("get", time.perf_counter() - t0)
        if faults and faults == len(keys):
            raise TierUnavailable(f"{self.name}: get failed")
        return ok

    def put(self, keys, src: torch.Tensor, rows=None) -> list[bool]:
        self._check_page(src)
        rows = rows_list(rows, len(keys))
        store = self._connect()
        ok = [False] * len(keys)
        faults = refused = 0
        rec, hdr = self.record_bytes, codec.HEADER_BYTES
        t0 = time.perf_counter()
        for lo in range(0, len(keys), self.staging_pages):
            chunk = keys[lo:lo + self.staging_pages]
            unsafe = False
            st = self._write
            with st.lock:
                if not st.registered:
                    self._register(store, st)
                buf = st.buf
                for j, k in enumerate(chunk):
                    copy_page(buf[j, hdr:], src[rows[lo + j]])
                    header = codec.pack_header(k, buf[j, hdr:].numpy())
                    buf[j, :hdr].numpy()[:] = np.frombuffer(header, dtype=np.uint8)
                base = st.ptr
                rc = store.batch_put_from([self._key(k) for k in chunk],
                                          [base + j * rec for j in range(len(chunk))],
                                          [rec] * len(chunk))
                for j, r in enumerate(rc):
                    if r == 0 or r == _ALREADY_EXISTS:
                        ok[lo + j] = True
                    elif r in _PUT_REFUSED:
                        refused += 1
                    else:
                        faults += 1
                        unsafe = unsafe or r in _UNSAFE
            if unsafe:
                self._retire("_write")
        self._account_put(keys, ok, refused, faults, t0)
        if faults and faults == len(keys):
            raise TierUnavailable(f"{self.name}: put failed")
        return ok

    def remove(self, keys) -> None:
        if not keys:
            return
        store = self._connect()
        # force: a recent read holds a lease on the object; a reader racing the removal can
        # only see a record that fails its checksum, never wrong data.
        rc = store.batch_remove([self._key(k) for k in keys], True)
        removed = [k for k, r in zip(keys, rc) if r == 0]
        if removed:
            self._emit(PagesRemoved(self.name, removed, "removed"))

    def clear(self) -> None:
        store = self._connect()
        store.remove_by_regex("^" + self.key_prefix.replace("/", "\\/"), True)
