"""KVTransferConnector: the engine's hooks for prefill/decode disaggregation.

Prefill leg (kv_transfer_params {"do_remote_decode": true}): the request runs as usual (the
router asks for one token); once it is freed, `on_freed` stages its pages (source.py) and the
finished output carries the params (None when nothing could be staged).
Decode leg (params naming a remote engine): `on_add` registers its pages with the PeerTier
before the scheduler sees the request; the tier connector's load path pulls what the device
lacks; `on_admit` / `on_finish` drop the registration and tell the prefill side it may free
its staging (once per request).

The transfer backend starts at the first transfer (a plain `serve` opens no port), and the
PeerTier joins the engine's tiers at the first decode leg: below the configured tiers
(TieredStore.add_tier), or in a peer-only TieredStore attached then when there are none.

Invariants:
- Malformed or unusable params never fail a request: it computes its prefix instead.
- Under --async-scheduling a prefill leg stages in the update of the step that wrote its pages,
  from rows no later step was given yet; an import's tier load starts once the step in flight
  at its claim has run (kv/connector/loads.py), and its tail copy, made at admission on the core
  thread, only with no step in flight: while a tail is read or ready the engine schedules with
  none in flight (tails_held, EngineCore._drain_first).
- Every registration is dropped exactly once, whatever way the request ends.
"""

from __future__ import annotations

import logging
import threading

from loomserve.kv.tiers.base import copy_page
from loomserve.kv.transfer.backend import InProcTransfer, KVTransfer
from loomserve.kv.transfer.params import is_prefill_leg, parse
from loomserve.kv.transfer.peer_tier import PeerTier
from loomserve.kv.transfer.source import TransferSource
from loomserve.kv.transfer.tail import TailReads, tail_rows, usable

log = logging.getLogger(__name__)

# The store's guard bounds every tier call: leave the peer's own timeout room inside it.
GUARD_MARGIN_S = 1.0


class KVTransferConnector:
    def __init__(self, control, kv, kv_buffer, identity, attach=None,
                 tiers=lambda: None) -> None:
        """control: ControlConfig; identity(): the model identity for tier keys (lazy: it
        digests the weights once); attach(store): connect a TieredStore when the engine has
        none; tiers(): the engine's TierConnector or None."""
        self.control = control
        self.kv = kv
        self.kv_buffer = kv_buffer
        self._identity = identity
        self._attach = attach
        self._tiers = tiers
        self.enabled = kv.enable_caching  # pages are named by block hashes
        self._transfer = None
        self._lock = threading.Lock()
        self._keyspaces = None
        self.source: TransferSource | None = None
        self.peer = PeerTier(kv.config.page_bytes, lambda: self.transfer,
                             control.kv_transfer_timeout)
        self.peer_attached = False
        self._legs: dict[str, str] = {}  # decode-leg request id -> transfer id
        self._tail_rows: dict[str, tuple] = {}  # prefill leg -> its tail block, before free
        self.tails = TailReads(self.peer, len(kv.config.groups), kv.config.page_bytes)
        self.counters = {"prefill_legs": 0, "decode_legs": 0, "unusable_params": 0,
                         "tails_applied": 0}

    @property
    def transfer(self):
        """The backend, started at first use (the engine thread stages, the peer tier's
        thread pulls: one backend for both, made once under a lock)."""
        with self._lock:
            if self._transfer is None:
                c = self.control
                self._transfer = make_transfer(c.kv_transfer_backend, c.kv_transfer_host)
                log.info("KV transfer: %s at %s", self._transfer.name,
                         self._transfer.session_id)
            return self._transfer

    @property
    def keyspaces(self) -> list:
        if self._keyspaces is None:
            from loomserve.kv.tiers import KeySpace, fingerprint_for
            model_id = self._identity()
            self._keyspaces = [KeySpace(fingerprint_for(self.kv.config, model_id, g))
                               for g in range(len(self.kv.config.groups))]
        return self._keyspaces

    def bound_by(self, store) -> None:
        """The peer tier sits in a configured store whose guard times calls out: a pull must
        end first (a timed-out call would mark the tier down for every prefill instance)."""
        self.peer.read_timeout_s = min(self.control.kv_transfer_timeout,
                                       max(0.1, store.op_timeout_s - GUARD_MARGIN_S / 2))

    # -- requests -----------------------------------------------------------------------------
    def on_add(self, req) -> None:
        """Before the scheduler sees req: note a prefill leg, register a decode leg's pages."""
        raw = getattr(req, "kv_transfer_params", None)
        if raw is None:
            return
        if is_prefill_leg(raw):
            req.remote_decode = self.enabled
            self.counters["prefill_legs"] += 1
            return
        try:
            params = parse(raw)
        except ValueError as e:  # the front end validates: only a raw core client gets here
            log.warning("request %s: kv_transfer_params ignored: %s", req.request_id, e)
            params = None
        if params is None or not self.enabled or \
                params.backend != self.control.kv_transfer_backend:
            self.counters["unusable_params"] += 1
            return
        if not self._ensure_peer():
            return
        if self.peer.add(params):
            self._legs[req.request_id] = params.transfer_id
            self.counters["decode_legs"] += 1
            if params.tail is not None and self._same_layout(params):
                self.tails.fetch(req.request_id, params.remote_engine, params.tail)

    def _same_layout(self, params) -> bool:
        """The params' groups are this engine's, in order (a tail has no key of its own)."""
        mine = self.keyspaces
        return not self.kv.has_state_groups and len(params.groups) == len(mine) and all(
            g.fingerprint == k.fingerprint for g, k in zip(params.groups, mine))

    def tail_waiting(self, req) -> bool:
        """req's tail is still on its way (bounded: TailReads.max_wait_s)."""
        return req.request_id in self._legs and self.tails.waiting(req.request_id)

    def tails_held(self) -> bool:
        """A waiting decode leg may get its tail copied at admission: on the core thread, into
        a block just allocated, which may be a row the step in flight still writes (async
        scheduling drains first, EngineCore._drain_first)."""
        return self.tails.holding()

    def tail_for(self, req, num_hit: int):
        """At admission: req's tail (tail, pages) when it continues a hit of num_hit tokens
        exactly (the scheduler then computes only the last prompt token), else None."""
        got = self.tails.get(req.request_id) if req.request_id in self._legs else None
        return got if got is not None and usable(got[0], req, num_hit) else None

    def apply_tail(self, req, got) -> None:
        """Copy got's (tail_for's) page per group into the block req was just given there."""
        tail, pages = got
        t = tail.start // self.kv.block_size
        rows = self.kv.coordinator.block_ids(req.request_id)
        for g, page in enumerate(pages):
            copy_page(self.kv_buffer[rows[g][t]], page)
        self.counters["tails_applied"] += 1

    def _ensure_peer(self) -> bool:
        """At the first decode leg: the PeerTier joins the engine's tiers below the configured
        ones, or a store of its own is attached when there are none."""
        if self.peer_attached:
            return True
        if self._attach is None:  # a layer kind without tier support: decode legs compute
            return False
        conn = self._tiers()
        if conn is not None:
            conn.store.add_tier(self.peer)
            self.bound_by(conn.store)
        else:
            from loomserve.kv.tiers import TieredStore
            self._attach(TieredStore([self.peer], op_timeout_s=self.control.kv_transfer_timeout
                                     + GUARD_MARGIN_S))
        self.peer_attached = True
        log.info("KV transfer: the peer tier is in the engine's tiers")
        return True

    def on_admit(self, req) -> None:
        """req is on the device with whatever it imported: release the prefill side."""
        self._release(req.request_id)

    def on_finish(self, req) -> None:
        self._release(req.request_id)

    def before_free(self, req) -> None:
        """A prefill leg about to free its blocks: note its tail block (tail.py)."""
        if getattr(req, "remote_decode", False):
            rows = tail_rows(self.kv, req)
            if rows is not None:
                self._tail_rows[req.request_id] = rows

    def _release(self, request_id: str) -> None:
        self.tails.drop(request_id)
        tid = self._legs.pop(request_id, None)
        if tid is None:
            return
        params = self.peer.drop(tid)
        if params is not None and params.notify and self._transfer is not None:
            self._transfer.notify(params.notify, tid.encode())  # (no backend: nothing pulled)

    def on_freed(self, req, finished_ok: bool) -> None:
        """After the KV manager freed req: a prefill leg's pages go to staging and its params
        onto req.kv_transfer_result (None when nothing could be staged)."""
        tail = self._tail_rows.pop(req.request_id, None)
        if not getattr(req, "remote_decode", False):
            return
        req.kv_transfer_result = None
        if not finished_ok:
            return
        try:
            if self.source is None:
                self.source = TransferSource(self.kv, self.kv_buffer, self.transfer,
                                             self.keyspaces, self.transfer.name,
                                             self.control.kv_transfer_timeout,
                                             self.control.kv_transfer_buffer)
            req.kv_transfer_result = self.source.stage(req, tail)
        except Exception:  # a backend that cannot start: the decode side computes
            log.exception("request %s: KV staging failed", req.request_id)

    # -- housekeeping -------------------------------------------------------------------------
    def poll(self) -> None:
        if self.source is not None:
            self.source.poll()

    def stats(self) -> dict:
        out = {**self.counters, "peer": dict(self.peer.counters), "tails": dict(self.tails.counters)}
        if self.source is not None:
            out["source"] = {**self.source.counters, "staged_now": len(self.source.staged),
                             "arena_free_pages": self.source.arena.num_free}
        return out

    def close(self) -> None:
        self.peer.close()
        if self._transfer is not None:
            self._transfer.close()
            self._transfer = None


def make_transfer(backend: str, host: str = "127.0.0.1") -> KVTransfer:
    """The configured backend (ControlConfig.kv_transfer_backend)."""
    if backend == "inproc":
        return InProcTransfer()
    if backend == "mooncake":
        from loomserve.kv.transfer.mooncake import MooncakeTransfer  # optional: mooncake
        return MooncakeTransfer(host)
    raise ValueError(f"unknown KV transfer backend {backend!r}")
