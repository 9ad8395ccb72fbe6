"""The HTTP server over AsyncLLM: the app, its shared routes, and one module per API.

OpenAI Chat Completions and Completions (openai_api.py), Anthropic Messages
(anthropic_api.py) and OpenAI Responses (responses_api.py) each register their routes here;
they share one Handler (handler.py: submit, stream, collect, abort, error mapping) and the
API-neutral chat layer (loomserve.entrypoints.chat). The engine core computes in its own
process (or thread); handlers only await its async iterators, so the event loop stays free.
"""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from loomserve.entrypoints.async_llm import EngineDeadError
from loomserve.entrypoints.server.anthropic_api import register_anthropic_routes
from loomserve.entrypoints.server.auth import APIKeyMiddleware
from loomserve.entrypoints.server.errors import (
    engine_failed,
    install_error_handlers,
    model_not_found,
)
from loomserve.entrypoints.server.handler import Handler
from loomserve.entrypoints.server.metrics import ServerMetrics
from loomserve.entrypoints.server.openai_api import register_openai_routes
from loomserve.entrypoints.server.protocol import ModelCard, ModelList
from loomserve.entrypoints.server.responses_api import register_responses_routes


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

    register_openai_routes(app, h)
    register_anthropic_routes(app, h)
    register_responses_routes(app, h)
    return app
