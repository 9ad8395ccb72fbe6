"""One request's life in the HTTP server: submit, wait, stream or collect, abort.

A request that loses its client is aborted: streams close the engine iterator in a `finally`,
non-streaming waits poll for the disconnect. Engine failures map to the API's error shape: a
full waiting queue is a 429 with Retry-After, a core that died under an in-flight request a
500, a core already dead a 503; after the headers of a stream, an error is an in-band event.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import uuid
from collections.abc import AsyncIterator

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Send

from loomserve.api.errors import (
    APIError,
    bad_request,
    engine_failed,
    error_body,
    model_not_found,
    overloaded,
)
from loomserve.api.metrics import RequestTimer, ServerMetrics
from loomserve.api.prompt_diff import SessionPrompts
from loomserve.engine.async_llm import EngineDeadError, EngineOverloadedError
from loomserve.engine.output import RequestOutput
from loomserve.sampling_params import SamplingParams

logger = logging.getLogger("loomserve.api")

DISCONNECT_POLL_S = 0.25
# Names what a request asked for and did not get, in every API: tools of hosted types (web
# search, Anthropic server tools, Codex's client-side ones), which no model here can run, are
# dropped rather than failing the request.
WARNING_HEADER = "x-loomserve-warning"


class ClientGone(Exception):
    pass


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, however the stream ends.

    Starlette leaves the iterator suspended when the client vanishes between two chunks; closing
    it here runs the generator's `finally` at once (aborting the engine request, or the router's
    upstream request) instead of whenever the garbage collector gets to it.
    """

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


class SSEResponse(ClosingStreamingResponse):
    media_type = "text/event-stream"


class Handler:
    """Shared by every API: the engine, its metrics, the chat front end (ChatFrontend) and the
    names the model is served under (the first is the one responses report)."""

    def __init__(self, engine, metrics: ServerMetrics, chat=None,
                 served_model_names: list[str] | None = None, tracing=None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.tracing = tracing  # tracing.Tracing, or None: no span, no SDK import
        self.chat = chat
        self.served_model_names = list(served_model_names or [engine.model_name])
        # Each session's latest rendered prompt: where a turn stopped extending the last one
        # (the text side of the `diverged` miss cause, api.prompt_diff).
        self.prompts = SessionPrompts()

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        """404 (model_not_found) unless `model` is None or one of the served names."""
        if model is not None and model not in self.served_model_names:
            raise model_not_found(model)

    def response_model(self, model: str | None) -> str:
        """The name a response reports: the one the request used, else the first served."""
        return model if model in self.served_model_names else self.model_name

    async def start(self, request: Request, prompt: str | list[int], params: SamplingParams,
                    request_id: str, *, session_id: str | None = None,
                    cache_salt: str | None = None, sibling_of: str | None = None,
                    kv_transfer_params: dict | None = None, priority: int = 0, n: int = 1,
                    prompt_text: str | None = None):
        """Submit to the engine and wait for the first output.

        Waiting before any byte is sent lets engine-side validation errors (prompt too long,
        bad token ids) become a 400 even for streams. session_id: what the API's body names
        (Anthropic metadata.user_id, Responses prompt_cache_key), resolved by `session_of`.
        sibling_of: another sample of the same prompt (n > 1), whose prompt KV this one reuses.
        priority: the scheduling priority (lower first), passed on only when set.
        n: the request's sample count (recorded once, by sample 0).
        prompt_text: the rendered chat prompt, compared with the session's previous one.
        """
        session = session_of(request, session_id)
        trace = None if self.tracing is None else self.tracing.request(
            request.headers, request_id, kv_transfer_params, self.model_name, params)
        timer = self.metrics.tracker(request_id, session_id=session, max_tokens=params.max_tokens,
                                     n=0 if sibling_of is not None else n, trace=trace)
        if prompt_text is not None and sibling_of is None:
            timer.divergence = self.prompts.observe(session, None, prompt_text)
        try:
            return await self._submit(request, prompt, params, request_id, timer, session,
                                      cache_salt, sibling_of, kv_transfer_params, priority)
        except BaseException as e:
            if trace is not None:
                trace.fail(e)
            raise

    async def _submit(self, request: Request, prompt, params: SamplingParams, request_id: str,
                      timer: RequestTimer, session: str | None, cache_salt: str | None,
                      sibling_of: str | None, kv_transfer_params: dict | None, priority: int):
        extra = {"sibling_of": sibling_of} if sibling_of is not None else {}
        if kv_transfer_params is not None:
            extra["kv_transfer_params"] = kv_transfer_params
        if priority:
            extra["priority"] = priority
        try:
            it = self.engine.generate(
                prompt, params, request_id,
                session_id=session,
                parent_session_id=request.headers.get("x-parent-session-id"),
                cache_salt=cache_salt, **extra)
            if inspect.isawaitable(it):
                it = await it
        except ValueError as e:
            raise bad_request(str(e)) from e
        except EngineDeadError as e:
            raise engine_failed(e) from e
        try:
            first = await self._until_disconnect(request, it.__anext__())
        except ValueError as e:
            await close_iterator(it)
            raise bad_request(str(e)) from e
        except EngineOverloadedError as e:
            await close_iterator(it)
            raise overloaded(str(e)) from e
        except EngineDeadError as e:
            await close_iterator(it)
            raise engine_failed(e) from e
        except StopAsyncIteration:
            raise APIError(500, "The engine ended the request without output.",
                           type="internal_server_error")
        except BaseException:
            await self._abort(it, request_id)
            raise
        timer.observe(first)
        return it, first, timer

    async def collect(self, request: Request, it, first: RequestOutput, timer: RequestTimer,
                      request_id: str) -> RequestOutput:
        async def drain() -> RequestOutput:
            out = first
            while not out.finished:
                try:
                    out = await it.__anext__()
                except StopAsyncIteration:
                    break
                timer.observe(out)
            return out

        try:
            out = await self._until_disconnect(request, drain())
        except EngineDeadError as e:
            await close_iterator(it)
            raise engine_failed(e) from e
        except BaseException:
            await self._abort(it, request_id)
            raise
        await close_iterator(it)
        return out

    async def _until_disconnect(self, request: Request, awaitable):
        """Await `awaitable`, cancelling it if the client goes away meanwhile."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    raise ClientGone()
        finally:
            if not task.done():
                task.cancel()

    async def _abort(self, it, request_id: str) -> None:
        # Closing the iterator aborts the request (engine contract); the explicit abort covers
        # a request the iterator had not yet handed to the engine loop.
        with anyio.CancelScope(shield=True):
            await close_iterator(it)
            try:
                await self.engine.abort(request_id)
            except Exception:  # already finished or never admitted
                pass

    # streams -------------------------------------------------------------------------------

    async def stream(self, it, first: RequestOutput, timer: RequestTimer, request_id: str,
                     chunks, *, encode=None, done: str | None = "data: [DONE]\n\n",
                     error=None) -> AsyncIterator[str]:
        """Yield SSE lines. `chunks(out, is_first)` turns one RequestOutput into payloads,
        `encode(payload)` one payload into SSE text (default: a `data:` line), `done` ends a
        stream that finished, `error(message, type, code)` is the in-band error event's text
        (default: OpenAI's error body as a `data:` line)."""
        encode = encode or sse
        error = error or (lambda message, type, code: sse(error_body(message, type, code=code)))
        out = first
        try:
            for payload in chunks(out, True):
                yield encode(payload)
            while not out.finished:
                try:
                    out = await it.__anext__()
                except StopAsyncIteration:
                    break
                except EngineDeadError as e:  # headers are sent: report in-band, as OpenAI does
                    yield error(f"The engine core failed: {e}", "internal_server_error",
                                "engine_core_failed")
                    break
                except Exception as e:
                    logger.exception("request %s failed mid-stream", request_id)
                    yield error(f"{type(e).__name__}: {e}", "internal_server_error", None)
                    break
                timer.observe(out)
                for payload in chunks(out, False):
                    yield encode(payload)
            if done:
                yield done
        finally:
            if out.finished:
                with anyio.CancelScope(shield=True):
                    await close_iterator(it)
            else:
                await self._abort(it, request_id)


async def close_iterator(it) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            logger.debug("closing the engine iterator failed", exc_info=True)


# Headers agent clients send that name their conversation, in order of precedence after
# X-Session-ID and the API body's own field: Claude Code's, then Codex's.
SESSION_HEADERS = ("x-session-id",)
FALLBACK_SESSION_HEADERS = ("x-claude-code-session-id", "session_id", "session-id")


def session_of(request: Request, body_session: str | None = None) -> str | None:
    """The session a request belongs to (prefix retention and pinning key on it): the
    X-Session-ID header, else the API body's field, else a client's own session header, else
    None (the request still runs, without session retention)."""
    for name in SESSION_HEADERS:
        if value := request.headers.get(name):
            return value
    if body_session:
        return body_session
    for name in FALLBACK_SESSION_HEADERS:
        if value := request.headers.get(name):
            return value
    return None


# Line breaks to Python's str.splitlines() (so httpx's aiter_lines and the clients built on it)
# beyond SSE's CR/LF. JSON escapes those below 0x20 already; pydantic leaves these three raw in
# strings, so a generated token holding one splits its `data:` line in two for such a client
# (a "bad SSE payload"). Escaped, the JSON decodes to the same text.
_LINE_BREAKS = (("\x85", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def _line_safe(data: str) -> str:
    for ch, escaped in _LINE_BREAKS:
        if ch in data:
            data = data.replace(ch, escaped)
    return data


def sse(payload) -> str:
    if hasattr(payload, "model_dump_json"):
        return f"data: {_line_safe(payload.model_dump_json(exclude_none=False))}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def sse_event(event: str, payload) -> str:
    """A named SSE event (Anthropic Messages, OpenAI Responses): `event:` then `data:`."""
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"event: {event}\ndata: {_line_safe(data)}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def with_transfer_params(payload: dict, asked: dict | None, outs: list[RequestOutput]) -> dict:
    """A non-streaming response body plus the top-level kv_transfer_params a prefill leg
    ({"do_remote_decode": true}) asked for: the first sample's, null when none was staged."""
    if isinstance(asked, dict) and asked.get("do_remote_decode") is True:
        payload["kv_transfer_params"] = outs[0].kv_transfer_params if outs else None
    return payload
