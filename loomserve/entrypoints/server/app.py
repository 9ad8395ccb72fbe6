"""OpenAI-compatible HTTP API over AsyncLLM.

The engine computes in its own thread; handlers only await its async iterator, so the event loop
stays free. A request that loses its client is aborted: streams close the engine iterator in a
`finally`, non-streaming waits poll for the disconnect.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Send

from loomserve.entrypoints.output import RequestOutput
from loomserve.entrypoints.server.errors import (
    APIError,
    bad_request,
    engine_unavailable,
    error_body,
    install_error_handlers,
    model_not_found,
)
from loomserve.entrypoints.server.metrics import RequestTimer, ServerMetrics
from loomserve.entrypoints.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ModelCard,
    ModelList,
    Usage,
    _SamplingRequest,
)

logger = logging.getLogger("loomserve.entrypoints.server")

DISCONNECT_POLL_S = 0.25


class _ClientGone(Exception):
    pass


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, however the stream ends.

    Starlette leaves the iterator suspended when the client vanishes between two chunks; closing
    it here runs the generator's `finally`, which aborts the engine request at once instead of
    whenever the garbage collector gets to it.
    """

    media_type = "text/event-stream"

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


class _Handler:
    def __init__(self, engine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def check_model(self, req: _SamplingRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise model_not_found(req.model)

    async def start(self, request: Request, prompt: str | list[int], req: _SamplingRequest,
                    request_id: str):
        """Submit to the engine and wait for the first output.

        Waiting before any byte is sent lets engine-side validation errors (prompt too long,
        bad token ids) become a 400 even for streams.
        """
        params = req.to_sampling_params()
        timer = self.metrics.tracker()
        try:
            it = self.engine.generate(
                prompt, params, request_id,
                session_id=request.headers.get("x-session-id"),
                parent_session_id=request.headers.get("x-parent-session-id"),
                cache_salt=req.cache_salt)
            if inspect.isawaitable(it):
                it = await it
        except ValueError as e:
            raise bad_request(str(e)) from e
        except RuntimeError as e:  # the engine loop died (EngineDeadError)
            raise engine_unavailable(e) from e
        try:
            first = await self._until_disconnect(request, it.__anext__())
        except ValueError as e:
            await _close(it)
            raise bad_request(str(e)) from e
        except RuntimeError as e:
            await _close(it)
            raise engine_unavailable(e) from e
        except StopAsyncIteration:
            raise APIError(500, "The engine ended the request without output.",
                           type="internal_server_error")
        except BaseException:
            await self._abort(it, request_id)
            raise
        timer.on_output(len(first.new_token_ids), first.finished, first.finish_reason)
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
                timer.on_output(len(out.new_token_ids), out.finished, out.finish_reason)
            return out

        try:
            out = await self._until_disconnect(request, drain())
        except BaseException:
            await self._abort(it, request_id)
            raise
        await _close(it)
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
                    raise _ClientGone()
        finally:
            if not task.done():
                task.cancel()

    async def _abort(self, it, request_id: str) -> None:
        # Closing the iterator aborts the request (engine contract); the explicit abort covers
        # a request the iterator had not yet handed to the engine loop.
        with anyio.CancelScope(shield=True):
            await _close(it)
            try:
                await self.engine.abort(request_id)
            except Exception:  # already finished or never admitted
                pass

    # streams -------------------------------------------------------------------------------

    async def stream(self, it, first: RequestOutput, timer: RequestTimer, request_id: str,
                     chunks) -> AsyncIterator[str]:
        """Yield SSE lines; `chunks(out)` turns one RequestOutput into payload dicts."""
        out = first
        try:
            for payload in chunks(out, True):
                yield _sse(payload)
            while not out.finished:
                try:
                    out = await it.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as e:  # headers are sent: report in-band, as OpenAI does
                    logger.exception("request %s failed mid-stream", request_id)
                    yield _sse(error_body(f"{type(e).__name__}: {e}", "internal_server_error"))
                    break
                timer.on_output(len(out.new_token_ids), out.finished, out.finish_reason)
                for payload in chunks(out, False):
                    yield _sse(payload)
            yield "data: [DONE]\n\n"
        finally:
            if out.finished:
                with anyio.CancelScope(shield=True):
                    await _close(it)
            else:
                await self._abort(it, request_id)


async def _close(it) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            logger.debug("closing the engine iterator failed", exc_info=True)


def _sse(payload) -> str:
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def build_app(engine) -> FastAPI:
    app = FastAPI(title="loomserve", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    metrics = ServerMetrics(engine, engine.model_name)
    h = _Handler(engine, metrics)
    app.state.engine = engine
    app.state.metrics = metrics
    started = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        try:
            if not getattr(engine, "is_healthy", True):
                raise RuntimeError("the engine loop has stopped")
            engine.stats()
        except Exception as e:
            return JSONResponse({"status": "error", "detail": str(e)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def get_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=engine.model_name, created=started,
                                         max_model_len=engine.max_model_len)])

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> ModelCard:
        if model != engine.model_name:
            raise model_not_found(model)
        return ModelCard(id=engine.model_name, created=started, max_model_len=engine.max_model_len)

    @app.delete("/v1/sessions/{session_id}")
    async def end_session(session_id: str) -> dict:
        """An agent session is over (or should no longer be kept warm): unpin its blocks and
        drop its prefix-hash memo. Idempotent; its cached blocks stay hittable until evicted."""
        await engine.end_session(session_id)
        return {"id": session_id, "object": "session", "deleted": True}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        h.check_model(body)
        body.check_unsupported()
        messages = [m.to_template_dict() for m in body.messages]
        tok = engine.tokenizer

        def render() -> list[int]:
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False)

        try:
            prompt_ids = await asyncio.to_thread(render)
        except ValueError as e:
            raise bad_request(str(e), param="messages") from e
        request_id = _new_id("chatcmpl")
        created = int(time.time())
        try:
            it, first, timer = await h.start(request, prompt_ids, body, request_id)
        except _ClientGone:
            return Response(status_code=499)

        if body.stream:
            include_usage = body.include_usage

            def chunk(choices, usage=None) -> ChatCompletionChunk:
                return ChatCompletionChunk(id=request_id, created=created, model=engine.model_name,
                                           choices=choices, usage=usage)

            def chunks(out: RequestOutput, is_first: bool):
                if is_first:
                    yield chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])
                if out.new_text:
                    yield chunk([ChatChunkChoice(delta=ChatDelta(content=out.new_text))])
                if out.finished:
                    yield chunk([ChatChunkChoice(delta=ChatDelta(),
                                                 finish_reason=out.finish_reason)])
                    if include_usage:
                        yield chunk([], Usage.of(out))

            return SSEResponse(h.stream(it, first, timer, request_id, chunks))

        try:
            out = await h.collect(request, it, first, timer, request_id)
        except _ClientGone:
            return Response(status_code=499)
        return JSONResponse(ChatCompletion(
            id=request_id, created=created, model=engine.model_name, usage=Usage.of(out),
            choices=[ChatChoice(message=AssistantMessage(content=out.text),
                                finish_reason=out.finish_reason)]).model_dump())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        h.check_model(body)
        body.check_unsupported()
        prompt = body.single_prompt()
        request_id = _new_id("cmpl")
        created = int(time.time())
        try:
            it, first, timer = await h.start(request, prompt, body, request_id)
        except _ClientGone:
            return Response(status_code=499)

        if body.stream:
            include_usage = body.include_usage

            def chunk(choices, usage=None) -> Completion:
                return Completion(id=request_id, created=created, model=engine.model_name,
                                  choices=choices, usage=usage)

            def chunks(out: RequestOutput, is_first: bool):
                if out.new_text or out.finished:
                    yield chunk([CompletionChoice(text=out.new_text,
                                                  finish_reason=out.finish_reason
                                                  if out.finished else None)])
                if out.finished and include_usage:
                    yield chunk([], Usage.of(out))

            return SSEResponse(h.stream(it, first, timer, request_id, chunks))

        try:
            out = await h.collect(request, it, first, timer, request_id)
        except _ClientGone:
            return Response(status_code=499)
        return JSONResponse(Completion(
            id=request_id, created=created, model=engine.model_name, usage=Usage.of(out),
            choices=[CompletionChoice(text=out.text, finish_reason=out.finish_reason)]
        ).model_dump())

    return app
