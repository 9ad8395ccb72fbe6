"""PeerTier: the decode side's view of KV a prefill instance staged, as a read-only KV tier.

A decode leg's kv_transfer_params name pages (tier key -> peer engine, remote address,
checksum); `add` registers them for the request's life, and the tier connector's normal load
path (loomserve.kv.connector.loads: lookup -> claim rows -> load -> cache -> admit) pulls the
ones the device lacks, so imported pages become prefix-cache blocks that later turns hit, and a
page that does not arrive is simply computed. Hit accounting names the source "peer".

Invariants:
- `get_into` writes a destination row only with bytes that passed the page's checksum; a
  failed, short or late read is a miss (False), never data, and never a tier fault (a dead
  prefill instance must not mark the tier down for the other peers' transfers).
- A read is bounded by `read_timeout_s`; a staging buffer a late read may still write into is
  retired, never reused.
- Keys a request registered are dropped when it is admitted or finished (`drop`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Sequence

import torch

from loomserve.kv.tiers import codec
from loomserve.kv.tiers.base import Tier, copy_page, rows_list
from loomserve.kv.tiers.io_priority import io_pool
from loomserve.kv.transfer.backend import TransferFailed
from loomserve.kv.transfer.params import TransferParams

log = logging.getLogger(__name__)


class PeerTier(Tier):
    name = "peer"
    local = False  # reads cross the network: bounded by the store's guard and our timeout
    index_in_memory = True  # contains() is a dict lookup
    readonly = True

    def __init__(self, page_bytes: int, transfer_factory, read_timeout_s: float = 5.0) -> None:
        super().__init__(page_bytes)
        self._factory = transfer_factory  # the backend is started at the first read
        self._transfer = None
        self.read_timeout_s = read_timeout_s
        self._lock = threading.Lock()
        self._pages: dict[bytes, tuple[str, str, int, int]] = {}  # key -> (tid, peer, addr, sum)
        self._transfers: dict[str, tuple[TransferParams, list[bytes], int]] = {}  # tid -> refs
        self._staging: torch.Tensor | None = None
        self._reader = io_pool(4, "peer-read")
        self.counters = {"registered": 0, "expired": 0, "failed_reads": 0, "bad_checksums": 0,
                         "pages_read": 0}

    @property
    def transfer(self):
        if self._transfer is None:
            self._transfer = self._factory()
        return self._transfer

    # -- registry (engine thread) -------------------------------------------------------------
    def add(self, params: TransferParams) -> bool:
        """Register a decode leg's pages; False when they are expired (the request computes)."""
        if params.expires_at <= time.time():
            self.counters["expired"] += 1
            return False
        if params.page_bytes != self.page_bytes:  # another layout: no key could match anyway
            return False
        with self._lock:
            entry = self._transfers.get(params.transfer_id)
            if entry is not None:
                self._transfers[params.transfer_id] = (entry[0], entry[1], entry[2] + 1)
                return True
            keys = []
            for key, addr, csum in params.pages():
                self._pages[key] = (params.transfer_id, params.remote_engine, addr, csum)
                keys.append(key)
            self._transfers[params.transfer_id] = (params, keys, 1)
        self.counters["registered"] += 1
        return True

    def drop(self, transfer_id: str) -> TransferParams | None:
        """Drop one request's reference; the params when that was the last one."""
        with self._lock:
            entry = self._transfers.get(transfer_id)
            if entry is None:
                return None
            params, keys, refs = entry
            if refs > 1:
                self._transfers[transfer_id] = (params, keys, refs - 1)
                return None
            del self._transfers[transfer_id]
            for k in keys:
                if self._pages.get(k, ("",))[0] == transfer_id:
                    del self._pages[k]
        return params

    # -- the tier interface -------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._pages for k in keys]

    def get_into(self, keys: Sequence[bytes], out: torch.Tensor, rows=None) -> list[bool]:
        t0 = time.perf_counter()
        rows = rows_list(rows, len(keys))
        with self._lock:
            found = [self._pages.get(k) for k in keys]
        ok = [False] * len(keys)
        by_peer: dict[str, list[int]] = {}
        for i, f in enumerate(found):
            if f is not None:
                by_peer.setdefault(f[1], []).append(i)
        for peer, idx in by_peer.items():
            staging = self._read(peer, [found[i][2] for i in idx])
            if staging is None:
                continue
            for j, i in enumerate(idx):
                if codec.checksum(staging[j].numpy()) != found[i][3]:
                    self.counters["bad_checksums"] += 1
                    continue
                copy_page(out[rows[i]], staging[j])
                ok[i] = True
        n = sum(ok)
        self.counters["pages_read"] += n
        self.stats.add(hits=n, misses=len(keys) - n, bytes_read=n * self.page_bytes)
        self.stats.observe("get", time.perf_counter() - t0)
        return ok

    def _read(self, peer: str, addrs: list[int]) -> torch.Tensor | None:
        """The pages at addrs of peer, in a registered staging buffer; None when the read
        failed or ran past read_timeout_s (that buffer is then retired)."""
        pb = self.page_bytes
        try:
            transfer = self.transfer
            staging = self._staging
            if staging is None or staging.shape[0] < len(addrs):
                staging = torch.empty((max(len(addrs), 64), pb), dtype=torch.uint8)
                transfer.register(staging)
                self._staging = staging
            base = staging.data_ptr()
            ops = [(a, base + j * pb, pb) for j, a in enumerate(addrs)]
            self._reader.submit(transfer.read, peer, ops).result(self.read_timeout_s)
            return staging
        except FutureTimeout:
            self._staging = None  # a late read may still write into it: never reused
            log.warning("KV pull from %s timed out after %.1fs: computing instead", peer,
                        self.read_timeout_s)
        except (TransferFailed, RuntimeError, ValueError, ImportError) as e:  # ImportError:
            # the backend cannot start here (e.g. Mooncake not installed)
            log.warning("KV pull from %s failed (%s): computing instead", peer, e)
        self.counters["failed_reads"] += 1
        return None

    def submit_read(self, peer: str, ops):
        """A read of ops [(remote address, local address, bytes)] on the reader threads, into
        memory registered with the backend; its Future (a decode leg's tail, tail.py)."""
        return self._reader.submit(self.transfer.read, peer, ops)

    def put(self, keys: Sequence[bytes], src: torch.Tensor, rows=None) -> list[bool]:
        return [False] * len(keys)  # read-only: pages come from prefill instances only

    def remove(self, keys) -> None:
        """Evict: nothing to do (registrations end with drop)."""

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)  # the backend is the connector's
