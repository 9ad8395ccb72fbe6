"""Redis as a lighter shared backend for small deployments (redis-py).

A page is one string value: the codec record (header + page), optionally with a TTL that a hit
refreshes. Capacity and eviction are Redis's own (`maxmemory` with an LRU policy); with
`noeviction` a full Redis refuses writes (an OOM reply), which is a refused put, not a fault.
Socket timeouts bound every call; a connection error or timeout raises TierUnavailable.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from loomserve.kv.tiers import codec
from loomserve.kv.tiers.base import PagesRemoved, Tier, TierUnavailable, cpu_row, rows_list


def import_redis():
    try:
        import redis
    except ImportError as e:
        raise ImportError("redis-py is not installed: pip install 'loomserve[tiers]' "
                          f"(or pip install redis). Cause: {e}") from e
    return redis


class RedisTier(Tier):
    name = "redis"

    def __init__(self, page_bytes: int, host: str = "127.0.0.1", port: int = 6379, db: int = 0,
                 url: str | None = None, ttl_s: float | None = None, timeout_s: float = 1.0,
                 key_prefix: bytes = b"ls:", name: str | None = None) -> None:
        super().__init__(page_bytes, name)
        redis = import_redis()
        self._errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._response_error = redis.ResponseError
        kw = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                  retry_on_timeout=False, health_check_interval=0)
        if url:
            self.client = redis.Redis.from_url(url, **kw)
        else:
            self.client = redis.Redis(host=host, port=port, db=db, **kw)
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.key_prefix = key_prefix

    def _k(self, key: bytes) -> bytes:
        return self.key_prefix + key

    def _pipeline_execute(self, fill):
        pipe = self.client.pipeline(transaction=False)
        fill(pipe)
        try:
            return pipe.execute(raise_on_error=False)
        except self._errors as e:
            self.stats.add(errors=1)
            raise TierUnavailable(f"{self.name}: {type(e).__name__}: {e}") from e

    def contains(self, keys) -> list[bool]:
        if not keys:
            return []
        t0 = time.perf_counter()
        res = self._pipeline_execute(lambda p: [p.exists(self._k(k)) for k in keys])
        self.stats.observe("contains", time.perf_counter() - t0)
        return [r == 1 for r in res]

    def get_into(self, keys, out: torch.Tensor, rows=None) -> list[bool]:
        self._check_page(out)
        rows = rows_list(rows, len(keys))
        if not keys:
            return []
        t0 = time.perf_counter()
        ks = [self._k(k) for k in keys]
        try:
            values = self.client.mget(ks)
        except self._errors as e:
            self.stats.add(errors=1)
            raise TierUnavailable(f"{self.name}: {type(e).__name__}: {e}") from e
        ok = [False] * len(keys)
        bad = []
        pb = self.page_bytes
        for i, v in enumerate(values):
            if v is None:
                continue
            try:
                payload = codec.decode(keys[i], v, pb)
            except codec.CorruptRecord:
                bad.append(keys[i])
                continue
            row = out[rows[i]]
            if row.device.type == "cpu":
                np.copyto(row.numpy(), np.frombuffer(payload, dtype=np.uint8).reshape(row.shape))
            else:
                row.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(row.shape))
            ok[i] = True
        if bad:
            try:
                self.client.delete(*[self._k(k) for k in bad])
            except self._errors:
                pass
            self._emit(PagesRemoved(self.name, bad, "corrupt"))
        hits_keys = [ks[i] for i in range(len(keys)) if ok[i]]
        if self.ttl_ms and hits_keys:
            self._pipeline_execute(lambda p: [p.pexpire(k, self.ttl_ms) for k in hits_keys])
        hits = len(hits_keys)
        self.stats.add(hits=hits, misses=len(keys) - hits, corrupt=len(bad), bytes_read=hits * pb)
        self.stats.observe("get", time.perf_counter() - t0)
        return ok

    def put(self, keys, src: torch.Tensor, rows=None) -> list[bool]:
        self._check_page(src)
        rows = rows_list(rows, len(keys))
        if not keys:
            return []
        t0 = time.perf_counter()
        values = [codec.encode(k, cpu_row(src, rows[i]).numpy()) for i, k in enumerate(keys)]

        def fill(p):
            for k, v in zip(keys, values):
                p.set(self._k(k), v, px=self.ttl_ms)

        res = self._pipeline_execute(fill)
        ok = [r is True for r in res]
        refused = sum(isinstance(r, self._response_error) for r in res)
        faults = len(keys) - sum(ok) - refused
        self._account_put(keys, ok, refused, faults, t0)
        return ok

    def touch(self, keys) -> None:
        if self.ttl_ms and keys:
            self._pipeline_execute(lambda p: [p.pexpire(self._k(k), self.ttl_ms) for k in keys])

    def remove(self, keys) -> None:
        if not keys:
            return
        try:
            self.client.delete(*[self._k(k) for k in keys])
        except self._errors as e:
            raise TierUnavailable(f"{self.name}: {e}") from e
        self._emit(PagesRemoved(self.name, list(keys), "removed"))

    def clear(self) -> None:
        try:
            batch = []
            for k in self.client.scan_iter(match=self.key_prefix + b"*", count=1000):
                batch.append(k)
                if len(batch) >= 1000:
                    self.client.delete(*batch)
                    batch.clear()
            if batch:
                self.client.delete(*batch)
        except self._errors as e:
            raise TierUnavailable(f"{self.name}: {e}") from e

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass
