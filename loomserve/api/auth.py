"""API keys: every route but /health and /metrics needs one when the server has any.

Accepted as `Authorization: Bearer <key>` (OpenAI clients) or `x-api-key: <key>` (Anthropic
clients); compared in constant time. A pure ASGI middleware, so streaming bodies pass through
untouched; a refusal is a 401 in the error shape of the API asked.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from loomserve.api.errors import error_response, unauthorized

OPEN_PATHS = frozenset({"/health", "/metrics"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys if k]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        err = unauthorized()
        response = error_response(err.status_code, err.message, err.type, code=err.code,
                                  headers={"WWW-Authenticate": "Bearer"}, path=scope["path"])
        await response(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        given = None
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
            elif name == b"x-api-key" and given is None:
                given = value.strip()
        return given is not None and any(hmac.compare_digest(given, k) for k in self.keys)
