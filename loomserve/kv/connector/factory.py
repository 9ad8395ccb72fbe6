"""What the engine needs to set tiers up: whether a model can be tiered, the store the tier
config asks for, and the content identity of the weights that goes into every page key.

Invariants:
- Every group kind of a tiered model has a manager that says which pages a hit reads
  (hit_positions) and how loaded pages become hittable (cache_loaded): TIERED_KINDS.
- Pages of different weights never hit each other, even in a shared pool: model_identity
  digests every byte of every weight file (and the model's config.json).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import tempfile

import xxhash

from loomserve.config import ModelConfig, TierConfig
from loomserve.kv.spec import KVCacheConfig

log = logging.getLogger(__name__)

# Layer kinds whose managers say which pages a hit reads (hit_positions) and how loaded pages
# become hittable (cache_loaded). A new kind is tiered once its manager does both.
TIERED_KINDS = frozenset({"full_attention", "sliding_window", "linear_state"})
WEIGHT_PATTERNS = ("*.safetensors", "*.gguf", "*.bin")
DIGEST_MEMO = "weight-digests.json"
CHUNK_BYTES = 8 << 20


def tiers_supported(kv_config: KVCacheConfig) -> bool:
    """Whether every group's layer kind can be tiered."""
    return all(g.spec.kind in TIERED_KINDS for g in kv_config.groups)


def build_tiered_store(config: TierConfig, page_bytes: int):
    """A TieredStore from the tier config (host -> disk -> remote), or None."""
    from loomserve.kv.tiers import DiskTier, HostTier, TieredStore
    tiers = []
    if config.host_cache_memory:
        tiers.append(HostTier(config.host_cache_memory, page_bytes))
    if config.disk_cache_dir:
        tiers.append(DiskTier(config.disk_cache_dir, config.disk_cache_size, page_bytes))
    if config.remote_scheme == "mooncake":
        from loomserve.kv.tiers.mooncake_tier import MooncakeTier
        tiers.append(MooncakeTier(config.remote_address, page_bytes))
    elif config.remote_scheme == "redis":
        from loomserve.kv.tiers.redis_tier import RedisTier
        tiers.append(RedisTier(page_bytes, url=config.remote_cache))
    if not tiers:
        return None
    return TieredStore(tiers, write_after_seen=config.tier_write_after_seen)


def model_identity(name: str, folder: str | None, memo_dir: str | None = None) -> str:
    """The content identity of the weights for the tier fingerprint: the model name plus, per
    weight file (and config.json, whose rope or norm settings change the KV of the same
    weights), its name, size and xxh3_128 digest of its whole content.

    Hashing a multi-GB checkpoint takes seconds, so each file's digest is memoized in
    `<memo_dir>/weight-digests.json`; memo_dir defaults to the converted-weight cache
    (ModelConfig.resolved_cache_dir: $LOOMSERVE_CACHE or ~/.cache/loomserve), not the model
    folder, which is often read-only (a shared HF snapshot, a mounted volume). An entry is keyed
    by the file's real path and used only while its size, mtime_ns and inode are unchanged (a
    rewrite, a copy or a replacement by a download changes one of them). The memo is a cache:
    unreadable or unwritable, the files are simply hashed again; concurrent writers replace the
    file atomically and the last one wins."""
    files = []
    if folder and os.path.isdir(folder):
        for pat in WEIGHT_PATTERNS:
            files += sorted(glob.glob(os.path.join(folder, pat)))
        config = os.path.join(folder, "config.json")
        if os.path.isfile(config):
            files.append(config)
    elif folder and os.path.isfile(folder):
        files = [folder]
    h = xxhash.xxh3_128()
    h.update(name.encode())
    if files:
        memo = _DigestMemo(memo_dir if memo_dir is not None else
                           ModelConfig().resolved_cache_dir)
        for f in files:
            size, digest = memo.digest(f)
            h.update(f"{os.path.basename(f)}:{size}:{digest}".encode())
        memo.save()
    return f"{name}@{h.hexdigest()}"


def hash_file(path: str) -> str:
    """xxh3_128 of the whole file, streamed in CHUNK_BYTES pieces."""
    h = xxhash.xxh3_128()
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


class _DigestMemo:
    """real path -> {size, mtime_ns, ino, xxh3_128}, read once, written once if it changed."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, DIGEST_MEMO)
        self.entries: dict[str, dict] = {}
        self.dirty = False
        try:
            with open(self.path) as f:
                entries = json.load(f)
            if isinstance(entries, dict):
                self.entries = entries
        except (OSError, ValueError):
            pass

    def digest(self, path: str) -> tuple[int, str]:
        real = os.path.realpath(path)
        st = os.stat(real)
        stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
        entry = self.entries.get(real)
        if isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items()) and \
                isinstance(entry.get("xxh3_128"), str):
            return st.st_size, entry["xxh3_128"]
        digest = hash_file(real)
        self.entries[real] = {**stamp, "xxh3_128": digest}
        self.dirty = True
        return st.st_size, digest

    def save(self) -> None:
        if not self.dirty:
            return
        entries = {p: e for p, e in self.entries.items() if os.path.exists(p)}  # drop the gone
        self.dirty = False
        tmp = None
        try:
            folder = os.path.dirname(self.path)
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".weight-digests.", dir=folder)
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:
            log.debug("weight digest memo not written (%s): %s", self.path, e)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
