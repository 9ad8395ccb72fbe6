"""Data parallelism: N engine cores behind one front end, and the coordinator that places
each request on one of them.

Each DP rank is a whole engine core in its own process (its own scheduler, KV pool and prefix
cache), started as a ProcCoreClient with `parallel.data_parallel_rank` set in its copy of the
config. DPCoreClient has ProcCoreClient's interface (submit, wait_ready, ready, is_alive,
shutdown, on_event), so AsyncLLM serves N cores exactly as it serves one.

Placement (DPPlacement), in order:
1. session stickiness: a session's turns, and a child session's (parent_session_id), go to the
   rank that served the session before, where its KV (and its pins) live; n > 1 samples
   (sibling_of) go to their first sample's rank, whose prompt KV they reuse.
2. cached prefix among the ranks whose load is within LOAD_SLACK of the least loaded: the rank
   holding the longest prefix of the prompt's block hashes. The index is built here from what
   was sent to each rank (chained hashes of full blocks, LRU-capped per rank): exact about what
   each rank was asked to compute, blind to its evictions, so it can overestimate a hit.
3. load: fewest requests in flight (waiting + running on that rank). The front end counts them
   itself, exactly and at once, instead of from the EngineStats snapshots, which lag by up to
   50 ms: a burst placed on stale stats would all land on one rank.

Failure: one dead rank fails the whole DP engine (CoreDead to AsyncLLM: every in-flight
request fails at once, /health answers 503 and `serve` exits for its supervisor to restart).
Serving on with fewer ranks is not built. Invariants: at most one CoreDead is forwarded and
nothing after it; events from all ranks are forwarded one at a time (one lock).
Stats: counters and gauges summed over ranks (kv_blocks_*, running, waiting, hits...), the step
target and cost-model errors as the max over ranks; per-rank snapshots in `rank_stats`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from loomserve.config import EngineConfig
from loomserve.engine.core_client import EngineStartError, ProcCoreClient
from loomserve.engine.dp_rank import rank_config
from loomserve.engine.dp_remote import RemoteCoreClient
from loomserve.engine.messages import (
    AbortRequests,
    CoreDead,
    CoreEvent,
    CoreInput,
    CoreOutputs,
    CoreReady,
    EndSession,
    EngineCoreRequest,
    EngineStats,
    Shutdown,
)

log = logging.getLogger("loomserve.engine")

LOAD_SLACK = 2  # a rank this many requests above the least loaded one is not chosen for a hit
MAX_INDEXED_BLOCKS = 1 << 16  # per rank, LRU
MAX_SESSIONS = 1 << 16
SHUTDOWN_GRACE_S = 3.0  # then a rank still exiting is terminated (its core is closed by then)


def block_hashes(token_ids: list[int], block_size: int, salt: str | None = None) -> list[int]:
    """Chained hashes of the prompt's full blocks (a block's hash covers everything before it,
    as the KV cache's own block hashes do)."""
    h = hash(("loomserve-dp", salt))
    out = []
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[i:i + block_size])))
        out.append(h)
    return out


class DPPlacement:
    """Chooses a rank per request (see the module docstring); not thread-safe (the client
    holds its lock). `load[r]`: requests in flight on rank r."""

    def __init__(self, num_ranks: int, block_size: int) -> None:
        self.num_ranks, self.block_size = num_ranks, block_size
        self.load = [0] * num_ranks
        self._index: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_ranks)]
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._rank_of: dict[str, int] = {}  # request id -> rank, while in flight
        self._next = 0  # round-robin among exact ties

    def place(self, req: EngineCoreRequest) -> int:
        """The rank for req; records it (in flight, its session, its prefix blocks)."""
        hashes = block_hashes(req.prompt_token_ids, self.block_size, req.cache_salt)
        rank = self._sticky(req)
        if rank is None:
            rank = self._best(hashes)
        self._rank_of[req.request_id] = rank
        self.load[rank] += 1
        if req.session_id is not None:
            self._remember(self._sessions, req.session_id, rank, MAX_SESSIONS)
        for h in hashes:
            self._remember(self._index[rank], h, None, MAX_INDEXED_BLOCKS)
        return rank

    def rank_of(self, request_id: str) -> int | None:
        return self._rank_of.get(request_id)

    def finished(self, request_id: str) -> None:
        rank = self._rank_of.pop(request_id, None)
        if rank is not None:
            self.load[rank] -= 1

    def end_session(self, session_id: str) -> int | None:
        """The session's rank (None: unknown here), forgotten."""
        return self._sessions.pop(session_id, None)

    def hit_blocks(self, rank: int, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._index[rank]:
                break
            n += 1
        return n

    def _sticky(self, req: EngineCoreRequest) -> int | None:
        if req.sibling_of is not None and req.sibling_of in self._rank_of:
            return self._rank_of[req.sibling_of]
        for sid in (req.session_id, req.parent_session_id):
            if sid is not None and sid in self._sessions:
                self._sessions.move_to_end(sid)
                return self._sessions[sid]
        return None

    def _best(self, hashes: list[int]) -> int:
        least = min(self.load)
        ranks = [r for r in range(self.num_ranks) if self.load[r] <= least + LOAD_SLACK]
        hits = {r: self.hit_blocks(r, hashes) for r in ranks}
        best = max(hits.values())
        if best > 0:  # the longest hit; among equal hits the least loaded
            return min((r for r in ranks if hits[r] == best), key=lambda r: self.load[r])
        tied = [r for r in ranks if self.load[r] == least]
        rank = tied[self._next % len(tied)]
        self._next += 1
        return rank

    @staticmethod
    def _remember(lru: OrderedDict, key, value, cap: int) -> None:
        lru[key] = value
        lru.move_to_end(key)
        if len(lru) > cap:
            lru.popitem(last=False)


def check_dp_supported(config: EngineConfig) -> None:
    """Features whose single resource the ranks would share are refused at DP > 1."""
    if config.control.role != "both" or config.control.kv_events_endpoint:
        raise EngineStartError("--data-parallel-size > 1 with --role prefill/decode or "
                               "--kv-events-endpoint is not supported yet")


class DPCoreClient:
    """N engine core processes behind one front end (see the module docstring)."""

    def __init__(self, config: EngineConfig, on_event: Callable[[CoreEvent], None],
                 log_level: str = "INFO") -> None:
        check_dp_supported(config)
        n = config.parallel.data_parallel_size
        self._on_event = on_event
        self._lock = threading.Lock()  # placement state, and one event forwarded at a time
        self._dead = False
        self.placement = DPPlacement(n, config.cache.block_size)
        self._dp_store = None  # DEP's rendezvous on one node: held here while the cores live
        pc = config.parallel
        if pc.enable_expert_parallel and pc.nnodes == 1 and not pc.dp_master_port:
            # imported here: the front end stays torch-free unless it hosts DEP's store
            from loomserve.execution.parallel.state import master_store
            self._dp_store = master_store("127.0.0.1", 0)
            config = dataclasses.replace(config, parallel=dataclasses.replace(
                pc, dp_master_port=self._dp_store.port))
        self.rank_stats = [EngineStats() for _ in range(n)]
        self.clients: list = []  # ProcCoreClient here; RemoteCoreClient on the other nodes
        local = config.parallel.dp_node_ranks(0)
        try:  # all ranks load their model at the same time
            for rank in range(n):
                if rank in local:
                    self.clients.append(ProcCoreClient(rank_config(config, rank),
                                                       self._rank_callback(rank), log_level))
                else:
                    self.clients.append(RemoteCoreClient(config, rank, self._rank_callback(rank)))
        except BaseException:
            self._kill_all()
            raise

    def _rank_callback(self, rank: int) -> Callable[[CoreEvent], None]:
        return lambda event: self._on_rank_event(rank, event)

    def wait_ready(self) -> CoreReady:
        readies = []
        for rank, client in enumerate(self.clients):
            try:
                readies.append(client.wait_ready())
            except EngineStartError as e:
                self._kill_all()
                raise EngineStartError(f"data-parallel rank {rank}: {e}") from None
        first = readies[0]
        for rank, ready in enumerate(readies[1:], 1):  # every node must serve the same model
            same = (ready.model_name, ready.block_size, ready.max_model_len, ready.vocab_size)
            if same != (first.model_name, first.block_size, first.max_model_len, first.vocab_size):
                self._kill_all()
                raise EngineStartError(f"data-parallel rank {rank} serves {same} (model, block "
                                       f"size, max length, vocab), rank 0 "
                                       f"{(first.model_name, first.block_size, first.max_model_len, first.vocab_size)}: "
                                       f"start every node with the same model flags")
        for rank, ready in enumerate(readies):
            log.info("data-parallel rank %d: engine core pid %d, KV cache %d tokens",
                     rank, ready.pid, ready.kv_capacity_tokens)
        self.pids = [r.pid for r in readies]
        self.ready = msgspec.structs.replace(
            readies[0],
            kv_capacity_tokens=sum(r.kv_capacity_tokens for r in readies),
            kv_blocks_total=sum(r.kv_blocks_total for r in readies),
            max_waiting_requests=sum(r.max_waiting_requests for r in readies))
        return self.ready

    # -- front end -> ranks ----------------------------------------------------------------
    def submit(self, msg: CoreInput) -> None:
        if isinstance(msg, EngineCoreRequest):
            with self._lock:
                rank = self.placement.place(msg)
            self.clients[rank].submit(msg)
        elif isinstance(msg, AbortRequests):
            by_rank: dict[int, list[str]] = {}
            with self._lock:
                for rid in msg.request_ids:
                    rank = self.placement.rank_of(rid)
                    if rank is not None:  # else finished already: nothing to abort
                        by_rank.setdefault(rank, []).append(rid)
            for rank, ids in by_rank.items():
                self.clients[rank].submit(AbortRequests(ids, msg.status))
        elif isinstance(msg, EndSession):
            with self._lock:
                rank = self.placement.end_session(msg.session_id)
            for client in (self.clients if rank is None else [self.clients[rank]]):
                client.submit(msg)
        elif isinstance(msg, Shutdown):
            for client in self.clients:
                client.submit(msg)
        else:
            raise TypeError(f"unknown core input {type(msg).__name__}")

    def is_alive(self) -> bool:
        return all(client.is_alive() for client in self.clients)

    def shutdown(self) -> None:
        with self._lock:
            self._dead = True  # closing: a rank failing as its peers leave is no news
        for client in self.clients:  # all at once: lockstep ranks leave together
            if client.is_alive():
                client.submit(Shutdown())
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for client in self.clients:
            client.join(max(0.0, deadline - time.monotonic()))
        for client in self.clients:
            if client.is_alive():  # closed, but its interpreter teardown is slow (gloo)
                client._close(kill=True)  # noqa: SLF001
            else:
                client.shutdown()

    def _kill_all(self) -> None:
        for client in self.clients:
            client._close(kill=True)  # noqa: SLF001 - a failed start: no orderly shutdown

    # -- ranks -> front end (each rank's receiver thread) ----------------------------------
    def _on_rank_event(self, rank: int, event: CoreEvent) -> None:
        with self._lock:
            if self._dead:
                return  # after the forwarded CoreDead: nothing more
            if isinstance(event, CoreOutputs):
                for out in event.outputs:
                    if out.finished:
                        self.placement.finished(out.request_id)
                stats = None
                if event.stats is not None:
                    self.rank_stats[rank] = event.stats
                    stats = aggregate_stats(self.rank_stats)
                self._on_event(CoreOutputs(event.outputs, stats))
            elif isinstance(event, CoreDead):
                self._dead = True
                log.error("data-parallel rank %d died: %s", rank, event.error)
                self._on_event(CoreDead(f"data-parallel rank {rank}: {event.error}",
                                        event.traceback))
            else:
                self._on_event(event)


_MAX_FIELDS = {"target_step_ms", "step_cost_error_p50", "step_cost_error_p90"}


def aggregate_stats(per_rank: list[EngineStats]) -> EngineStats:
    """One snapshot for the whole DP engine: numbers summed (the step target and cost-model
    errors: the max), per-key sums of count dicts, per-position sums of count lists, tier
    snapshots concatenated."""
    out = {}
    for f in msgspec.structs.fields(EngineStats):
        values = [getattr(s, f.name) for s in per_rank]
        if f.name in _MAX_FIELDS:
            out[f.name] = max(values)
        elif f.name == "tier_snapshots":
            out[f.name] = [snap for v in values for snap in v]
        elif isinstance(values[0], dict):
            merged: dict = {}
            for v in values:
                for k, x in v.items():
                    merged[k] = merged.get(k, 0) + x if isinstance(x, (int, float)) else x
            out[f.name] = merged
        elif isinstance(values[0], list):  # per-position counts: summed position by position
            width = max(map(len, values))
            out[f.name] = [sum(v[i] for v in values if i < len(v)) for i in range(width)]
        else:
            out[f.name] = sum(values)
    return EngineStats(**out)
