"""The HTTP server over AsyncLLM: the app, its shared routes, and one module per API.

OpenAI Chat Completions and Completions (openai_api.py), Anthropic Messages
(anthropic_api.py) and OpenAI Responses (responses_api.py) each register their routes here;
they share one Handler (handler.py: submit, stream, collect, abort, error mapping) and the
API-neutral chat layer (loomserve.api.chat). The engine core computes in its own
process (or thread); handlers only await its async iterators, so the event loop stays free.
"""

from __future__ import annotations

import json
import logging
import os
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from loomserve.api.anthropic_api import register_anthropic_routes
from loomserve.api.auth import APIKeyMiddleware
from loomserve.api.chat.frontend import ChatFrontend
from loomserve.api.errors import (
    engine_failed,
    install_error_handlers,
    model_not_found,
)
from loomserve.api.handler import Handler
from loomserve.api.metrics import ServerMetrics
from loomserve.api.openai_api import register_openai_routes
from loomserve.api.protocol import ModelCard, ModelList
from loomserve.api.responses_api import register_responses_routes
from loomserve.api.tokenize_api import register_tokenize_routes
from loomserve.engine.async_llm import EngineDeadError

log = logging.getLogger("loomserve.api")


def build_app(engine, api_keys: list[str] | None = None, *,
              served_model_names: list[str] | None = None, chat_template: str | None = None,
              tool_call_parser: str = "auto", reasoning_parser: str = "auto",
              response_store=None, otlp_traces_endpoint: str | None = None) -> FastAPI:
    """The app over an AsyncLLM-like engine; with api_keys, every route but /health and
    /metrics needs one of them. served_model_names: the names requests may use (default: the
    engine's); chat_template: a template's text overriding the model's; the parser names as
    the serve flags take them (auto, none, or a name); response_store: the Responses API's
    store of previous responses (default: ResponseStore()); otlp_traces_endpoint: where
    traces go (tracing.py; None: no tracing, the SDK never imported). ValueError for an
    unknown parser."""
    app = FastAPI(title="loomserve", docs_url=None, redoc_url=None)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, keys=list(api_keys))
    install_error_handlers(app)
    names = list(served_model_names or [engine.model_name])
    metrics = ServerMetrics(engine, names[0])
    chat = ChatFrontend(engine.tokenizer, tool_call_parser, reasoning_parser,
                        model_type=model_type_of(engine), chat_template=chat_template)
    log.info("chat: tool-call parser %s, reasoning parser %s%s", chat.tool_parser_name,
             chat.reasoning_parser_name,
             "" if chat.renderer is None or chat.renderer.supports_tools
             else " (the chat template has no tools: Hermes fallback)")
    tracing = None
    if otlp_traces_endpoint:
        from loomserve.api.tracing import Tracing
        tracing = Tracing(otlp_traces_endpoint, "loomserve")
    h = Handler(engine, metrics, chat, names, tracing)
    app.state.tracing = tracing
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.handler = h
    started = int(time.time())

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=started, max_model_len=engine.max_model_len,
                         root=getattr(engine.ready, "model_folder", None) or name)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            dead = engine.dead
            detail = dead.error if dead is not None else "the engine core has stopped"
            return JSONResponse({"status": "error", "detail": detail}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/info")
    async def info() -> dict:
        """What a router needs to place requests here (behind the API key when one is set)."""
        return instance_info(engine, names)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[card(name) for name in names])

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> ModelCard:
        if model not in names:
            raise model_not_found(model)
        return card(model)

    @app.delete("/v1/sessions/{session_id}")
    async def end_session(session_id: str) -> dict:
        """An agent session is over (or should no longer be kept warm): unpin its blocks and
        drop its prefix-hash memo. Idempotent; its cached blocks stay hittable until evicted."""
        try:
            await engine.end_session(session_id)
        except EngineDeadError as e:
            raise engine_failed(e) from e
        return {"id": session_id, "object": "session", "deleted": True}

    register_openai_routes(app, h)
    register_anthropic_routes(app, h)
    register_responses_routes(app, h, response_store)
    register_tokenize_routes(app, h)
    return app


def instance_info(engine, names: list[str]) -> dict:
    """This instance for the control plane: names, role, limits, KV events addresses (as
    bound: a wildcard host means "the host you reached me at"), and the tokenizer's folder."""
    ready = engine.ready
    events = None
    if getattr(ready, "kv_events_endpoint", None):
        events = {"endpoint": ready.kv_events_endpoint,
                  "replay_endpoint": ready.kv_events_replay_endpoint,
                  "topic": ready.kv_events_topic}
    return {"object": "loomserve.instance", "model": names[0], "served_model_names": names,
            "role": getattr(ready, "role", "both"), "block_size": ready.block_size,
            "max_model_len": engine.max_model_len, "kv_capacity_tokens": ready.kv_capacity_tokens,
            "kv_blocks_total": ready.kv_blocks_total,
            "model_folder": os.path.abspath(ready.model_folder),
            "kv_events": events, "pid": ready.pid}


def model_type_of(engine) -> str | None:
    """The HF config's model_type of the served model (parser detection reads it)."""
    ready = getattr(engine, "ready", None)
    folder = getattr(ready, "model_folder", None)
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type")
    except (OSError, TypeError, ValueError):
        return None
