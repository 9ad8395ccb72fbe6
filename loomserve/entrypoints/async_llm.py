"""Asyncio front of the engine: the server's only way in.

The engine core runs in one background thread (a forward pass never blocks the event loop);
requests and aborts reach it through a command queue, and its outputs come back to each
request's asyncio.Queue through call_soon_threadsafe. Detokenization and stop strings run on
the event loop side (RequestState), so the core's step stays token-ids only.

Contract
--------
AsyncLLM(config: EngineConfig) loads the model and allocates the KV cache.
Attributes: tokenizer, model_name (served name), max_model_len, vocab_size, config,
kv_capacity_tokens.
async generate(prompt, params, request_id=None, *, session_id=None, parent_session_id=None,
cache_salt=None) -> AsyncIterator[RequestOutput]: validates first (ValueError with a user-facing
message), then yields one RequestOutput per batch of new tokens; the last has finished=True.
Closing the iterator early (client gone, task cancelled) aborts the request and frees its blocks.
async abort(request_id); async end_session(session_id); stats() -> EngineStats; shutdown().
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator

from loomserve.config import EngineConfig
from loomserve.entrypoints.output import RequestOutput
from loomserve.entrypoints.processor import InputProcessor, RequestState
from loomserve.entrypoints.tokenizer import Tokenizer
from loomserve.execution.core import CoreOutput, EngineCore
from loomserve.execution.messages import EngineStats
from loomserve.execution.request import RequestStatus
from loomserve.sampling_params import SamplingParams

log = logging.getLogger("loomserve.execution")


class EngineDeadError(RuntimeError):
    """The engine loop hit an internal error; the request could not be completed."""


class AsyncLLM:
    def __init__(self, config: EngineConfig, core: EngineCore | None = None) -> None:
        self.config = config
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._error: BaseException | None = None
        if core is None:
            self.core = self._start_engine_thread()
        else:  # a caller-built core: the thread only runs the loop
            self.core, self._stats = core, core.stats()
            self._thread = threading.Thread(target=self._loop, name="loomserve-engine", daemon=True)
            self._thread.start()
        runner = self.core.runner
        self.tokenizer = Tokenizer.from_folder(runner.model_folder, runner.model_config.eos_token_ids)
        self.model_name = config.model.served_model_name or runner.model_name
        self.max_model_len = self.core.max_model_len
        self.vocab_size = runner.vocab_size
        self.kv_capacity_tokens = runner.kv_cache_config.capacity_tokens
        self.inputs = InputProcessor(self.tokenizer, self.max_model_len, self.vocab_size)

    def _start_engine_thread(self) -> EngineCore:
        """Build the core inside the thread that will drive it. On CPU every thread that runs
        parallel torch ops gets its own OpenMP team; once two teams exist (threads > cores),
        libgomp throttles spin-waiting and each of the ~600 ops of a step pays a wake-up:
        a decode step measured 30% slower than with one team. So the model is loaded, and every
        forward pass runs, on this one thread."""
        ready, box = threading.Event(), {}

        def boot() -> None:
            try:
                box["core"] = self.core = EngineCore(self.config)
                self._stats = self.core.stats()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the constructor
                box["error"] = exc
                return
            finally:
                ready.set()
            self._loop()

        self._thread = threading.Thread(target=boot, name="loomserve-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if "error" in box:
            raise box["error"]
        return box["core"]

    # -- public API ------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, *, session_id: str | None = None,
                       parent_session_id: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error!r}")
        request_id = request_id or uuid.uuid4().hex
        req = self.inputs.make_request(request_id, prompt, params, session_id=session_id,
                                       parent_session_id=parent_session_id, cache_salt=cache_salt)
        state = RequestState(request_id, req.prompt_token_ids, params, self.tokenizer)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._send(("add", req))
        try:
            while not state.finished:
                outs = [await stream.get()]
                while not stream.empty():
                    outs.append(stream.get_nowait())
                if any(isinstance(o, BaseException) for o in outs):
                    raise EngineDeadError(f"engine failed: {self._error!r}")
                out = state.process(outs)
                if state.stopped_by_string:
                    self._send(("abort", request_id, RequestStatus.FINISHED_STOPPED))
                    state.stopped_by_string = False
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not state.finished:
                self._send(("abort", request_id, RequestStatus.FINISHED_ABORTED))

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id, RequestStatus.FINISHED_ABORTED))

    async def end_session(self, session_id: str) -> None:
        """Release the session's pinned blocks and hash memo (its agent is done)."""
        self._send(("end_session", session_id))

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.core.close()

    # -- engine thread ---------------------------------------------------------------------
    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _loop(self) -> None:
        core = self.core
        while not self._stopped:
            self._drain_commands()
            if not core.has_work():
                core.idle()
                self._stats = core.stats()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = core.step()
            except BaseException as exc:  # noqa: BLE001 - report, fail the requests, stop
                log.exception("engine step failed")
                self._error = exc
                self._fail_all(exc)
                return
            self._stats = core.stats()
            self._dispatch(outputs)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                if cmd[1].request_id in self._streams:  # not abandoned before it arrived
                    self.core.add_request(cmd[1])
            elif cmd[0] == "end_session":
                self.core.end_session(cmd[1])
            else:
                self.core.abort(cmd[1], cmd[2])

    def _dispatch(self, outputs: list[CoreOutput]) -> None:
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                loop, stream = target
                loop.call_soon_threadsafe(stream.put_nowait, out)

    def _fail_all(self, exc: BaseException) -> None:
        for loop, stream in list(self._streams.values()):
            loop.call_soon_threadsafe(stream.put_nowait, exc)
