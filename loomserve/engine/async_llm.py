"""The asyncio front end of the engine: the server's only way in.

The engine core runs in its own process (or, with in_process=True, in a thread of this one);
requests and aborts go to it as messages, and its outputs come back on a client thread that
hands each batch to the event loop with one call_soon_threadsafe. Validation, tokenization,
detokenization and stop strings run here, so the core's GIL only ever runs the engine.

Contract: AsyncLLM(config, in_process=False) starts the core and returns once the model is
loaded (EngineStartError otherwise). Attributes: tokenizer, model_name, max_model_len,
vocab_size, config, kv_capacity_tokens, ready (the core's CoreReady). generate() validates first
(ValueError with a user-facing message), then yields one RequestOutput per batch of new tokens;
the last has finished=True. A full waiting queue raises EngineOverloadedError before the first
output; a core that dies raises EngineDeadError in every in-flight and later request. Closing
the iterator early (client gone, task cancelled) aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable

from loomserve.config import EngineConfig
from loomserve.engine.core_client import EngineStartError, ProcCoreClient, ThreadCoreClient
from loomserve.engine.messages import (
    REJECTED,
    AbortRequests,
    CoreDead,
    CoreEvent,
    CoreOutputs,
    EndSession,
    EngineStats,
)
from loomserve.engine.output import RequestOutput
from loomserve.engine.processor import InputProcessor, RequestState
from loomserve.engine.tokenizer import Tokenizer
from loomserve.sampling_params import SamplingParams

log = logging.getLogger("loomserve.engine")

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError", "EngineStartError"]


class EngineDeadError(RuntimeError):
    """The engine core failed. in_flight: the request was already in the core when it did."""

    def __init__(self, message: str, in_flight: bool) -> None:
        super().__init__(message)
        self.in_flight = in_flight


class EngineOverloadedError(RuntimeError):
    """The core's waiting queue is full (--max-waiting-requests): retry later."""


class AsyncLLM:
    def __init__(self, config: EngineConfig, *, in_process: bool = False,
                 log_level: str = "INFO") -> None:
        self.config = config
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # _streams is read by the client thread
        self._dead: CoreDead | None = None
        self._dead_callbacks: list[Callable[[CoreDead], None]] = []
        self._stats = EngineStats()
        if config.parallel.data_parallel_size > 1:  # N engine cores (entrypoints.dp_client)
            if in_process:
                raise EngineStartError("--data-parallel-size > 1 runs one process per engine "
                                       "core: drop --engine-in-process")
            from loomserve.engine.dp_client import DPCoreClient
            self.client = DPCoreClient(config, self._on_event, log_level)
            Tokenizer.preload()
        elif in_process:
            self.client = ThreadCoreClient(config, self._on_event)
        else:
            self.client = ProcCoreClient(config, self._on_event, log_level)
            Tokenizer.preload()  # seconds of imports, while the core loads the model
        ready = self.ready = self.client.wait_ready()
        self._stats.kv_blocks_total = ready.kv_blocks_total
        self.tokenizer = Tokenizer.from_folder(ready.model_folder, tuple(ready.eos_token_ids))
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.kv_capacity_tokens = ready.kv_capacity_tokens
        self.num_params = ready.num_params
        self.inputs = InputProcessor(self.tokenizer, self.max_model_len, self.vocab_size)

    @property
    def core(self):
        """The EngineCore object, only when it runs in this process (in_process=True)."""
        return getattr(self.client, "core", None)

    # -- public API ------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, *, session_id: str | None = None,
                       parent_session_id: str | None = None,
                       cache_salt: str | None = None,
                       sibling_of: str | None = None,
                       kv_transfer_params: dict | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """sibling_of: n > 1, this sample's prompt prefill waits for that request's, so it
        reuses its prompt KV blocks (prefix caching). kv_transfer_params: a prefill or decode
        leg of prefill/decode disaggregation (loomserve.kv.transfer.params). priority: the
        scheduling priority (vLLM's; lower is served first)."""
        self._check_alive()
        request_id = request_id or uuid.uuid4().hex
        msg = self.inputs.make_core_request(
            request_id, prompt, params, session_id=session_id,
            parent_session_id=parent_session_id, cache_salt=cache_salt, sibling_of=sibling_of,
            kv_transfer_params=kv_transfer_params, priority=priority)
        state = RequestState(request_id, msg.prompt_token_ids, params, self.tokenizer)
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._check_alive()
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        try:
            self.client.submit(msg)
            while not state.finished:
                outs = [await stream.get()]
                while not stream.empty():
                    outs.append(stream.get_nowait())
                if any(isinstance(o, CoreDead) for o in outs):
                    raise EngineDeadError(f"the engine core failed: {self._dead.error}",
                                          in_flight=True)
                if outs[0].finish_reason == REJECTED:
                    state.finished = True  # the core holds nothing of it
                    raise EngineOverloadedError(
                        f"the server is overloaded: {self.ready.max_waiting_requests} requests "
                        "are already waiting (--max-waiting-requests); retry later")
                out = state.process(outs)
                if state.stopped_by_string:
                    self._submit(AbortRequests([request_id], "stop"))
                    state.stopped_by_string = False
                yield out
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not state.finished:
                self._submit(AbortRequests([request_id], "abort"))

    async def abort(self, request_id: str) -> None:
        self._submit(AbortRequests([request_id], "abort"))

    async def end_session(self, session_id: str) -> None:
        """Release the session's pinned blocks and hash memo (its agent is done)."""
        self._check_alive()
        self._submit(EndSession(session_id))

    def stats(self) -> EngineStats:
        """The core's latest snapshot (never older than a response already delivered)."""
        return self._stats

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self.client.is_alive()

    @property
    def dead(self) -> CoreDead | None:
        return self._dead

    def on_dead(self, callback: Callable[[CoreDead], None]) -> None:
        """Call `callback(CoreDead)` (from a client thread) once the core has died."""
        self._dead_callbacks.append(callback)
        if self._dead is not None:
            callback(self._dead)

    def shutdown(self) -> None:
        self.client.shutdown()

    # -- core events (client thread) -------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine core is not running: {self._dead.error}",
                                  in_flight=False)

    def _submit(self, msg) -> None:
        if self._dead is None:
            self.client.submit(msg)

    def _on_event(self, event: CoreEvent) -> None:
        if isinstance(event, CoreOutputs):
            if event.stats is not None:
                self._stats = event.stats  # before the outputs: metrics lead responses
            self._dispatch(event.outputs)
        elif isinstance(event, CoreDead):
            self._die(event)

    def _dispatch(self, outputs) -> None:
        per_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        with self._lock:
            for out in outputs:
                target = self._streams.get(out.request_id)
                if target is not None:
                    per_loop[target[0]].append((target[1], out))
        for loop, batch in per_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that event loop is closed: its requests are gone
                pass

    def _die(self, event: CoreDead) -> None:
        with self._lock:
            self._dead = event
            targets = list(self._streams.values())
        log.error("the engine core died: %s", event.error)
        for loop, stream in targets:
            try:
                loop.call_soon_threadsafe(stream.put_nowait, event)
            except RuntimeError:
                pass
        for callback in self._dead_callbacks:
            callback(event)


def _deliver(batch: list) -> None:
    for stream, out in batch:
        stream.put_nowait(out)
