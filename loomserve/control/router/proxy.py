"""Relaying one request to an instance: headers, waits that end when the instance dies, SSE
passthrough, and errors in the API's own shape.

Every wait on an instance races its `went_down` event (set by the health checker or a refused
connection) and a timeout, so a request in flight to an instance that dies or hangs ends
within the health checker's detection time (< 2 s) instead of waiting on a dead socket. A
stream that breaks after its headers were sent ends with an error event in the API's SSE shape
(OpenAI: a `data:` line holding {"error": ...}; Anthropic: `event: error`; Responses: an
`error` event), then closes.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import httpx

from loomserve.api.errors import anthropic_error_body, error_body
from loomserve.api.handler import ClosingStreamingResponse
from loomserve.control.router.instances import Instance, Lease
from loomserve.control.router.tokens import API_MESSAGES, API_RESPONSES

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host",
                        "content-length", "accept-encoding", "content-encoding", "date",
                        "server"})
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp[_-][^"]+)"')
_SNIFF_BYTES = 8192


class InstanceLost(Exception):
    """The instance went down (or stopped answering) while a request waited on it."""


def request_headers(headers, instance_api_key: str | None) -> dict[str, str]:
    """The client's headers minus hop-by-hop ones; its key replaced by the instances' key
    when the router has one. Identity encoding: the router relays bytes as they come."""
    out = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}
    if instance_api_key:
        out = {k: v for k, v in out.items() if k.lower() not in ("authorization", "x-api-key")}
        out["authorization"] = f"Bearer {instance_api_key}"
    out["accept-encoding"] = "identity"
    return out


def response_headers(headers: httpx.Headers, extra: dict[str, str]) -> dict[str, str]:
    out = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}
    out.update(extra)
    return out


def sse_error(api: str, message: str, code: str = "instance_failed") -> bytes:
    """An in-band error event closing a broken stream, in the API's SSE shape."""
    if api == API_MESSAGES:
        data = anthropic_error_body(502, message)
        return f"\n\nevent: error\ndata: {json.dumps(data)}\n\n".encode()
    if api == API_RESPONSES:
        data = {"type": "error", "code": code, "message": message, "param": None}
        return f"\n\nevent: error\ndata: {json.dumps(data)}\n\n".encode()
    data = error_body(message, "api_error", code=code)
    return f"\n\ndata: {json.dumps(data)}\n\n".encode()


def response_id_in(data: bytes) -> str | None:
    m = _RESPONSE_ID.search(data[:_SNIFF_BYTES])
    return m.group(1).decode() if m else None


async def until_down(aw: Awaitable, inst: Instance, timeout: float):
    """Await `aw` unless the instance goes down or `timeout` passes first (InstanceLost)."""
    down = inst.went_down
    if down.is_set():
        raise InstanceLost(f"instance {inst.name} is down")
    task = asyncio.ensure_future(aw)
    waiter = asyncio.ensure_future(down.wait())
    try:
        done, _ = await asyncio.wait((task, waiter), timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if task in done:
        return task.result()
    task.cancel()
    why = "went down" if waiter in done else f"sent nothing for {timeout:g} s"
    raise InstanceLost(f"instance {inst.name} {why}")


class ClosingStream(ClosingStreamingResponse):
    """Always closes its body iterator and runs `on_close`, however the stream ends (a client
    that vanishes between chunks, or before the first), so the upstream request is closed
    and the lease released even when the iterator never started."""

    def __init__(self, *args, on_close: Callable[[], Awaitable[None]], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_close()



class Upstream:
    """The HTTP client to the instances (one connection pool for all)."""

    def __init__(self, read_timeout: float = 600.0, connect_timeout: float = 2.0) -> None:
        self.read_timeout = read_timeout
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    async def aclose(self) -> None:
        await self.client.aclose()

    async def open(self, inst: Instance, method: str, path: str, content: bytes | None,
                   headers: dict[str, str]) -> httpx.Response:
        """Send the request; returns once the instance sent its headers. httpx.ConnectError
        and ConnectTimeout mean nothing reached it (safe to retry elsewhere)."""
        req = self.client.build_request(method, inst.url + path, content=content,
                                        headers=headers)
        return await until_down(self.client.send(req, stream=True), inst, self.read_timeout)

    async def read_all(self, resp: httpx.Response, inst: Instance) -> bytes:
        try:
            return await until_down(resp.aread(), inst, self.read_timeout)
        finally:
            await resp.aclose()

    async def relay(self, resp: httpx.Response, inst: Instance, lease: Lease, api: str,
                    on_error: Callable[[str], None],
                    on_response_id: Callable[[str], None] | None = None) -> AsyncIterator[bytes]:
        """The instance's SSE bytes as they come; an error event if the instance fails."""
        it = resp.aiter_raw()
        sniffed = on_response_id is None
        try:
            while True:
                try:
                    chunk = await until_down(it.__anext__(), inst, self.read_timeout)
                except StopAsyncIteration:
                    return
                lease.on_tokens(chunk.count(b"data:"))
                if not sniffed and (rid := response_id_in(chunk)):
                    sniffed = True
                    on_response_id(rid)
                yield chunk
        except (httpx.HTTPError, InstanceLost) as e:
            kind = "instance_lost" if isinstance(e, InstanceLost) else "stream_broken"
            on_error(kind)
            yield sse_error(api, f"The instance serving this request failed mid-stream "
                                 f"({inst.name}: {e or type(e).__name__}).")
        finally:
            lease.release()
            with anyio.CancelScope(shield=True):
                await resp.aclose()
