"""The core loop: one thread drives one EngineCore, whatever carries its messages.

Each turn: take the front end's inputs (waiting for them only when there is no work), run one
step or the idle housekeeping, send the outputs. Under `--stream-interval N` a request's
outputs are held until N tokens gathered; its first and its finishing output go at once, and
every send of a stats snapshot (at most STATS_INTERVAL_S apart while busy) takes all that is
held, so no token waits longer than that; an aborted request's held outputs are dropped.

A transport hands inputs in and events out: a ZMQ pair when the core has its own process
(core_proc.py), a queue and a callback when it runs in a thread of the front end's process.

Supervision: any exception on any path (an add, an abort, a step, the tier poll, the idle
work) ends the loop: it is logged with its traceback and reported as CoreDead, the last event
the core sends; the front end then fails every in-flight request. A stuck request is never an
outcome: the loop either keeps stepping or is dead and says so.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Protocol

from loomserve.engine.messages import (
    AbortRequests,
    CoreDead,
    CoreEvent,
    CoreInput,
    CoreOutputs,
    EndSession,
    EngineCoreRequest,
    EngineStats,
    Shutdown,
)
from loomserve.engine.sched.request import RequestStatus

log = logging.getLogger("loomserve.engine")

IDLE_WAIT_S = 0.25  # how long an idle core waits for input before its housekeeping
STATS_INTERVAL_S = 0.05  # most frequent stats snapshot while busy
_STATUS = {"abort": RequestStatus.FINISHED_ABORTED, "stop": RequestStatus.FINISHED_STOPPED}


class CoreTransport(Protocol):
    def recv(self, timeout: float) -> list[CoreInput]:
        """Inputs that arrived, waiting up to `timeout` seconds for the first; [] if none."""

    def send(self, event: CoreEvent) -> None:
        ...


class CoreLoop:
    def __init__(self, core, transport: CoreTransport) -> None:
        self.core = core
        self.transport = transport
        self._outputs: list = []  # due to go with the next send
        # --stream-interval: outputs held back per request, their token count, and the
        # requests that already had an output sent (a first token is never held).
        self._interval = core.config.scheduler.stream_interval
        self._held: dict[str, list] = {}
        self._held_tokens: dict[str, int] = {}
        self._started: set[str] = set()
        self._dirty = True  # something changed since the last stats snapshot
        self._stats_at = 0.0
        self._last_stats: EngineStats | None = None

    def run(self) -> int:
        """Serve until a Shutdown (0) or an exception (1, after sending CoreDead). A core that
        steps in lockstep with peer ranks (peer_grace_s > 0) and fails in a collective because
        a peer left on the front end's Shutdown exits 0 too, once its own Shutdown arrives
        within that grace: the peers cannot all leave the collective at the same instant."""
        try:
            self._run()
            return 0
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the front end
            if self._shutdown_within(getattr(self.core, "peer_grace_s", 0.0)):
                log.info("a peer rank left on the front end's Shutdown (%s): stopping",
                         type(exc).__name__)
                return 0
            tb = traceback.format_exc()
            log.error("engine core failed; failing every in-flight request\n%s", tb)
            try:
                self.transport.send(CoreDead(f"{type(exc).__name__}: {exc}", tb))
            except Exception:  # the transport is gone too: the front end sees the exit
                log.exception("could not report the failure to the front end")
            return 1

    def _shutdown_within(self, grace_s: float) -> bool:
        """Whether a Shutdown arrives within grace_s seconds (other inputs are dropped: the
        core is failing either way)."""
        deadline = time.monotonic() + grace_s
        while grace_s > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if any(isinstance(m, Shutdown) for m in self.transport.recv(min(left, 0.1))):
                return True
        return False

    def _run(self) -> None:
        core = self.core
        while True:
            for msg in self.transport.recv(0.0 if core.has_work() else IDLE_WAIT_S):
                if isinstance(msg, Shutdown):
                    return
                self._handle(msg)
            if core.has_work():
                self._collect(core.step())
                self._dirty = True
            else:
                core.idle()
            self._flush()

    def _handle(self, msg: CoreInput) -> None:
        self._dirty = True
        if isinstance(msg, EngineCoreRequest):
            rejected = self.core.add(msg)
            if rejected is not None:
                self._outputs.append(rejected)
        elif isinstance(msg, AbortRequests):
            status = _STATUS[msg.status]
            for rid in msg.request_ids:
                self.core.abort(rid, status)
                self._forget(rid)  # the front end has ended it: its held tokens go nowhere
        elif isinstance(msg, EndSession):
            self.core.end_session(msg.session_id)
        else:
            raise TypeError(f"unknown core input {type(msg).__name__}")

    def _collect(self, outputs: list) -> None:
        """Queue a step's outputs; under a stream interval > 1 hold each request's back until
        it has gathered that many tokens, unless it is the request's first or last."""
        if self._interval == 1:
            self._outputs += outputs
            return
        for out in outputs:
            rid = out.request_id
            self._held.setdefault(rid, []).append(out)
            count = self._held_tokens.get(rid, 0) + len(out.new_token_ids)
            self._held_tokens[rid] = count
            if out.finished or rid not in self._started or count >= self._interval:
                self._release(rid)
                if out.finished:
                    self._started.discard(rid)
                else:
                    self._started.add(rid)

    def _release(self, rid: str) -> None:
        self._outputs += self._held.pop(rid, ())
        self._held_tokens.pop(rid, None)

    def _forget(self, rid: str) -> None:
        self._held.pop(rid, None)
        self._held_tokens.pop(rid, None)
        self._started.discard(rid)

    def _flush(self) -> None:
        """Send the outputs gathered so far, with a stats snapshot when one is due: after a
        request finished (so /metrics is never behind a response), every STATS_INTERVAL_S
        while busy, on going idle, and when idle housekeeping changed something."""
        now = time.monotonic()
        idle = not self.core.has_work()
        stats = None
        if self._dirty and (idle or now - self._stats_at >= STATS_INTERVAL_S
                            or any(o.finished for o in self._outputs)):
            stats = self.core.stats()
        elif idle and now - self._stats_at >= IDLE_WAIT_S:
            fresh = self.core.stats()
            stats = fresh if fresh != self._last_stats else None
            self._stats_at = now
        if stats is not None:
            self._dirty, self._stats_at, self._last_stats = False, now, stats
            for rid in list(self._held):  # a held token waits at most one stats interval
                self._release(rid)
        if self._outputs or stats is not None:
            outputs, self._outputs = self._outputs, []
            self.transport.send(CoreOutputs(outputs, stats))
