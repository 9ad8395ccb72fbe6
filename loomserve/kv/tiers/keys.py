"""Tier keys: a layout fingerprint followed by the block's chained hash.

A page is only meaningful to an engine that lays it out the same way: same model weights, KV
dtype, block size, page layout (page_bytes, which groups, which layers) and layer group. All of
that is hashed into a 16-byte fingerprint that prefixes every key, so two engines that differ in
any of it never hit each other's pages, even in a shared pool. The block hash (16 bytes, chained
xxh3-128 from loomserve.kv.hashing) already covers the tokens and the cache salt.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

FINGERPRINT_BYTES = 16
_VERSION = b"loomserve-tier-v1"


def layout_fingerprint(model_id: str, dtype: str, block_size: int, page_bytes: int,
                       group_id: int = 0, layout: str = "") -> bytes:
    """16-byte digest of what makes a page's bytes interpretable. `model_id` should name the
    weights (path or hub id plus revision), `layout` any further layout description (e.g. the
    groups' specs); both are opaque strings here."""
    desc = "\x1f".join([model_id, str(dtype), str(block_size), str(page_bytes), str(group_id),
                        layout])
    return xxhash.xxh3_128_digest(_VERSION + b"\x00" + desc.encode())


def fingerprint_for(kv_config, model_id: str, group_id: int = 0) -> bytes:
    """Fingerprint of one group of a loomserve KVCacheConfig (its page layout is the whole
    config's: every group shares the pool's page_bytes)."""
    groups = ";".join(f"{g.spec!r}@{g.layer_ids}" for g in kv_config.groups)
    spec = kv_config.groups[group_id].spec
    dtype = getattr(spec, "dtype", "")
    return layout_fingerprint(model_id, str(dtype), kv_config.block_size, kv_config.page_bytes,
                              group_id, groups)


@dataclass(frozen=True)
class KeySpace:
    """Makes tier keys (fingerprint + block hash) for one model/layout/group."""

    fingerprint: bytes

    def key(self, block_hash: bytes) -> bytes:
        return self.fingerprint + block_hash

    def keys(self, block_hashes) -> list[bytes]:
        fp = self.fingerprint
        return [fp + h for h in block_hashes]

    def owns(self, key: bytes) -> bool:
        return key.startswith(self.fingerprint)

    def block_hash(self, key: bytes) -> bytes:
        return key[len(self.fingerprint):]
