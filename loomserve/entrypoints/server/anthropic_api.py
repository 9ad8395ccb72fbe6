"""Anthropic Messages API: POST /v1/messages, POST /v1/messages/count_tokens (to build: issue 10)."""

from __future__ import annotations

from fastapi import FastAPI

from loomserve.entrypoints.server.handler import Handler


def register_anthropic_routes(app: FastAPI, h: Handler) -> None:
    pass
