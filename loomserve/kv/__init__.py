"""Data plane: the KV cache (block pool, per-layer-type managers, prefix hashing, retention,
eviction, planning), the tiers below the device (tiers/) and the connector between them
(connector/). Imports nothing from execution/, entrypoints/ or control/."""
