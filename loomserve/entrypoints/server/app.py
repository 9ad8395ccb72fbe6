"""OpenAI-compatible HTTP API over AsyncLLM: the routes.

The engine core computes in its own process (or thread); handlers only await its async
iterators, so the event loop stays free. The request lifecycle (submit, stream, collect, abort,
error mapping) is in handler.py; API keys in auth.py.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from loomserve.entrypoints.async_llm import EngineDeadError
from loomserve.entrypoints.output import RequestOutput
from loomserve.entrypoints.server.auth import APIKeyMiddleware
from loomserve.entrypoints.server.errors import (
    bad_request,
    engine_failed,
    install_error_handlers,
    model_not_found,
)
from loomserve.entrypoints.server.handler import ClientGone, Handler, SSEResponse, new_id
from loomserve.entrypoints.server.metrics import ServerMetrics
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
)


def build_app(engine, api_keys: list[str] | None = None) -> FastAPI:
    """The app over an AsyncLLM-like engine; with api_keys, every route but /health and
    /metrics needs one of them."""
    app = FastAPI(title="loomserve", docs_url=None, redoc_url=None)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, keys=list(api_keys))
    install_error_handlers(app)
    metrics = ServerMetrics(engine, engine.model_name)
    h = Handler(engine, metrics)
    app.state.engine = engine
    app.state.metrics = metrics
    started = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            dead = engine.dead
            detail = dead.error if dead is not None else "the engine core has stopped"
            return JSONResponse({"status": "error", "detail": detail}, status_code=503)
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
        try:
            await engine.end_session(session_id)
        except EngineDeadError as e:
            raise engine_failed(e) from e
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
        request_id = new_id("chatcmpl")
        created = int(time.time())
        try:
            it, first, timer = await h.start(request, prompt_ids, body, request_id)
        except ClientGone:
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
        except ClientGone:
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
        request_id = new_id("cmpl")
        created = int(time.time())
        try:
            it, first, timer = await h.start(request, prompt, body, request_id)
        except ClientGone:
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
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(Completion(
            id=request_id, created=created, model=engine.model_name, usage=Usage.of(out),
            choices=[CompletionChoice(text=out.text, finish_reason=out.finish_reason)]
        ).model_dump())

    return app
