"""Prefill/decode disaggregation, the instance side: KV pages move from a prefill instance to a
decode instance.

Flow (the handshake of vLLM's kv_transfer_params):
1. The router sends the client's body with max tokens 1 and kv_transfer_params
   {"do_remote_decode": true} to a prefill instance. It runs the prompt; when the request is
   freed, the pages a prefix hit of the prompt reads (every group: attention and window
   blocks, and a hybrid model's state checkpoint at that boundary) are copied into a registered
   host staging arena (source.py) and the answer carries kv_transfer_params (params.py): the
   peer engine, per page its tier key, address and checksum, and an expiry.
2. The router sends the original body plus those params to a decode instance. Its
   KVTransferConnector (connector.py) registers the pages with a read-only PeerTier
   (peer_tier.py) inside the engine's TieredStore, and the tier connector's ordinary load path
   pulls the pages its device lacks into claimed pool rows and caches them under their hashes,
   so the admission (and every later turn) hits them. Hit accounting calls the source "peer".
3. The decode side tells the prefill side it is done (a release notice); the prefill side frees
   the staging then, or at the expiry (kv_transfer_timeout).

Faults: an expired, unknown, failed, short, late or corrupt transfer leaves pages un-imported
and they are computed on the decode instance (checksums and tier keys guard every page: a
different model, layout or prompt never imports). Backends (backend.py): Mooncake Transfer
Engine (mooncake.py; TCP, RDMA where present) and an in-process one for tests.
"""

# Lazy exports: the front end validates kv_transfer_params (params.py) without importing the
# backends' torch (~2 s of every front end's start).
_EXPORTS = {"InProcTransfer": "backend", "KVTransfer": "backend", "TransferFailed": "backend",
            "make_transfer": "connector", "KVTransferConnector": "connector",
            "TransferParams": "params", "is_prefill_leg": "params", "parse": "params",
            "validate": "params", "PeerTier": "peer_tier", "StagingArena": "source",
            "TransferSource": "source"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
