"""Error bodies in each API's own shape.

OpenAI routes: {"error": {"message", "type", "param", "code"}}. Anthropic routes (/v1/messages
and below): {"type": "error", "error": {"type", "message"}} with Anthropic's type names. Every
failure the server reports goes through here, so clients see the shape and status codes they
expect, and FastAPI's own 422 / HTML shapes never leak out.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("loomserve.api")


class APIError(Exception):
    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model",
                    code="model_not_found")


def engine_failed(exc) -> APIError:
    """500 when the core died under this request, 503 when it was already dead."""
    if getattr(exc, "in_flight", False):
        return APIError(500, f"The engine core failed: {exc}", type="internal_server_error",
                        code="engine_core_failed")
    return APIError(503, f"The engine is unavailable: {exc}", type="service_unavailable_error",
                    code="engine_unavailable")


# Seconds a client is told to wait after a 429: one scheduler step frees little, a second of
# decode at the default batch frees many waiting slots; clients back off further themselves.
RETRY_AFTER_S = 1


def overloaded(message: str) -> APIError:
    return APIError(429, f"{message[0].upper()}{message[1:]}.", type="rate_limit_error",
                    code="too_many_waiting_requests", headers={"Retry-After": str(RETRY_AFTER_S)})


def unauthorized() -> APIError:
    return APIError(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                    code="invalid_api_key")


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Anthropic's error type for each status code (docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                    529: "overloaded_error"}
ANTHROPIC_PATH = "/v1/messages"


def anthropic_error_body(status_code: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status_code, "api_error"),
                                       "message": message}}


def error_response(status_code: int, message: str, type: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None,
                   path: str = "") -> JSONResponse:
    """The error in the shape of the API `path` belongs to (OpenAI's unless Anthropic's)."""
    if path.startswith(ANTHROPIC_PATH):
        body = anthropic_error_body(status_code, message)
    else:
        body = error_body(message, type, param, code)
    return JSONResponse(body, status_code=status_code, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"Malformed JSON body: {first.get('msg', '')}", None
    # Pydantic reports a union mismatch once per member ("prompt.str", "prompt.list[int]"...);
    # the user only needs the field name.
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    message = f"{where}: {first.get('msg', 'invalid value')}"
    if len(errors) > 1 and all(
            [str(p) for p in e.get("loc", ()) if p != "body"][:1] == loc[:1] for e in errors):
        message = f"{param}: invalid value ({first.get('msg', '')})"
    return message, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status_code, exc.message, exc.type, exc.param, exc.code,
                              exc.headers, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param,
                              path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"Unknown route: {request.method} {request.url.path}"
        return error_response(exc.status_code, message, "invalid_request_error", None, code,
                              path=request.url.path)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"Internal server error: {type(exc).__name__}: {exc}",
                              "internal_server_error", path=request.url.path)
