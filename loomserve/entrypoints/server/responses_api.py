"""OpenAI Responses API: POST /v1/responses (to build: issue 10)."""

from __future__ import annotations

from fastapi import FastAPI

from loomserve.entrypoints.server.handler import Handler


def register_responses_routes(app: FastAPI, h: Handler) -> None:
    pass
