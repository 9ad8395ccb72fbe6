"""Per-layer-type KV managers and their registry (layer kind -> manager class).

New layer types plug in by subclassing SingleTypeKVManager (base.py) and registering the
kind here; the pool and the coordinator do not change. To be tiered (loomserve.kv.connector,
TIERED_KINDS), a manager also says which pages a hit reads (hit_positions) and how pages
loaded from a tier become hittable (cache_loaded).
"""

from __future__ import annotations

from loomserve.kv.managers.base import SingleTypeKVManager, count_free
from loomserve.kv.managers.full_attention import FullAttentionManager
from loomserve.kv.managers.linear_state import LinearStateManager
from loomserve.kv.managers.sliding_window import SlidingWindowManager
from loomserve.kv.pool import BlockPool
from loomserve.kv.spec import KVCacheSpec

MANAGER_REGISTRY: dict[str, type[SingleTypeKVManager]] = {
    m.kind: m for m in (FullAttentionManager, SlidingWindowManager, LinearStateManager)}


def register_manager(cls: type[SingleTypeKVManager]) -> type[SingleTypeKVManager]:
    """Register a manager class for its layer kind (a plug-in's own layer type)."""
    MANAGER_REGISTRY[cls.kind] = cls
    return cls


def manager_class(spec: KVCacheSpec) -> type[SingleTypeKVManager]:
    try:
        return MANAGER_REGISTRY[spec.kind]
    except KeyError:
        raise NotImplementedError(f"no KV manager for layer kind {spec.kind!r}") from None


def manager_for(spec: KVCacheSpec, group_id: int, pool: BlockPool) -> SingleTypeKVManager:
    return manager_class(spec)(spec, group_id, pool)


__all__ = ["MANAGER_REGISTRY", "SingleTypeKVManager", "count_free", "manager_class",
           "manager_for", "register_manager"]
