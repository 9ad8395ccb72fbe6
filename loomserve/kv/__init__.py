"""Data plane: the KV cache (block pool, per-layer-type managers, prefix hashing, the hybrid
coordinator, retention, eviction, planning), its events and their publisher, the tiers below the
device (tiers/), the connector between pool and tiers (connector/) and the KV hand-over between
prefill and decode instances (transfer/). Imports only loomserve.config. Design:
docs/design/kv-cache.md, tiers.md, pd-disaggregation.md.
"""
