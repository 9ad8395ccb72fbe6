"""Fixtures: random pages, key spaces, and the real services (redis-server, Mooncake master +
standalone storage client) on 127.0.0.1 free ports. A service whose binary or package is absent
skips its tests with a loud reason (a failure under CI: tests/conftest.py); `make test` installs
them (`make services` the system packages, `make install` the Python ones)."""

from __future__ import annotations

import threading

import pytest
import torch

from loomserve.control.store_launcher import MooncakeService, RedisService, find_mooncake_binary
from loomserve.kv.tiers import KeySpace, Tier, TierUnavailable, layout_fingerprint

PAGE = 4096


def loud_skip(what: str, how: str, why: str):
    pytest.skip(f"!!! {what} NOT AVAILABLE, TESTS SKIPPED !!! {why}. Install: {how}")


def pages(n: int, page_bytes: int = PAGE, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, page_bytes), dtype=torch.uint8, generator=g)


def keyspace(page_bytes: int = PAGE, model: str = "test-model", group: int = 0) -> KeySpace:
    return KeySpace(layout_fingerprint(model, "torch.bfloat16", 16, page_bytes, group))


def block_hashes(n: int, tag: int = 0) -> list[bytes]:
    return [tag.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(n)]


@pytest.fixture
def ks():
    return keyspace()


def require_mooncake():
    from loomserve.kv.tiers.mooncake_tier import import_store
    try:
        import_store()
    except ImportError as e:
        loud_skip("MOONCAKE STORE", "apt-get install -y libibverbs1 && pip install "
                  "'loomserve[tiers]' (mooncake-transfer-engine-non-cuda)", str(e))
    if not find_mooncake_binary("mooncake_master") or not find_mooncake_binary("mooncake_client"):
        loud_skip("MOONCAKE STORE", "pip install mooncake-transfer-engine-non-cuda",
                  "mooncake_master/mooncake_client not found")


def require_redis():
    try:
        import redis  # noqa: F401
    except ImportError as e:
        loud_skip("REDIS", "pip install 'loomserve[tiers]' (redis)", str(e))
    try:
        RedisService()
    except FileNotFoundError as e:
        loud_skip("REDIS", "apt-get install -y redis-server", str(e))


@pytest.fixture(scope="module")
def mooncake_service(tmp_path_factory):
    require_mooncake()
    svc = MooncakeService(segment_bytes=64 << 20, log_dir=tmp_path_factory.mktemp("mooncake"))
    svc.start()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def redis_service():
    require_redis()
    svc = RedisService().start()
    yield svc
    svc.stop()


class GatedTier(Tier):
    """Wraps a tier; while `gate` is clear every call blocks (a slow backend), and with
    `down` set every call raises TierUnavailable (a dead one)."""

    def __init__(self, inner: Tier, name: str = "gated") -> None:
        super().__init__(inner.page_bytes, name)
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.down = False
        self.calls = 0

    def _enter(self) -> None:
        self.calls += 1
        self.gate.wait(30)
        if self.down:
            raise TierUnavailable(f"{self.name} is down")

    def contains(self, keys):
        self._enter()
        return self.inner.contains(keys)

    def get_into(self, keys, out, rows=None):
        self._enter()
        return self.inner.get_into(keys, out, rows)

    def put(self, keys, src, rows=None):
        self._enter()
        return self.inner.put(keys, src, rows)

    def remove(self, keys):
        self._enter()
        self.inner.remove(keys)
