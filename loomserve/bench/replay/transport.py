"""The replay's HTTP client: one streaming POST /v1/completions per request, plus JSON calls.

`Transport` is the protocol the driver, the probe and the scrape talk to; `HttpxTransport` is
the real one (an httpx.AsyncClient with a connection pool, SSE parsed here); tests substitute an
in-process fake server.

Invariants:
- `stream` yields each SSE data payload as a dict and stops at `[DONE]`; every failure
  surfaces as `TransportError(kind)`, kind one of http_<status> | timeout | connection |
  protocol | stream_error, never as an httpx exception.
- the endpoint may be given with or without a trailing /v1: paths are rooted at the server.
- SSE lines end at CR, LF or CRLF only (`sse_lines`; the benchmarks' clients use it too).
"""

from __future__ import annotations

import json
import re
from typing import AsyncIterator, Protocol

__all__ = ["TransportError", "Transport", "HttpxTransport", "sse_lines"]


class TransportError(Exception):
    """kind: http_<status> | timeout | connection | protocol | stream_error"""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class Transport(Protocol):
    def stream(self, body: dict, headers: dict) -> AsyncIterator[dict]:
        """POST /v1/completions with stream=True; yield each SSE data payload (parsed JSON)."""
        ...

    async def request_json(self, method: str, path: str, body: dict | None = None
                           ) -> tuple[int, dict | str | None]: ...

    async def aclose(self) -> None: ...


class HttpxTransport:
    """httpx.AsyncClient with a connection pool; SSE parsed here (data lines, blank-line ends)."""

    def __init__(self, endpoint: str, pool: int = 64, request_timeout: float = 600.0,
                 connect_timeout: float = 10.0, api_key: str | None = None) -> None:
        import httpx

        self._httpx = httpx
        root = endpoint.rstrip("/")
        if root.endswith("/v1"):
            root = root[:-3]
        self.root = root
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(
            base_url=root, headers=headers,
            timeout=httpx.Timeout(request_timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=max(16, pool)))

    def _kind(self, e: Exception) -> str:
        h = self._httpx
        if isinstance(e, h.TimeoutException):
            return "timeout"
        if isinstance(e, (h.RemoteProtocolError, h.DecodingError, h.LocalProtocolError)):
            return "protocol"
        return "connection"

    async def stream(self, body: dict, headers: dict) -> AsyncIterator[dict]:
        h = self._httpx
        try:
            async with self.client.stream("POST", "/v1/completions", json=body,
                                          headers=headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    raise TransportError(f"http_{resp.status_code}", text[:300])
                data: list[str] = []
                async for line in sse_lines(resp.aiter_text()):
                    if line:
                        if line.startswith("data:"):
                            data.append(line[5:][1:] if line[5:6] == " " else line[5:])
                        continue  # comments and other fields are ignored
                    if not data:
                        continue
                    payload, data = "\n".join(data), []
                    if payload.strip() == "[DONE]":
                        return
                    yield _parse(payload)
                if data and "\n".join(data).strip() != "[DONE]":
                    yield _parse("\n".join(data))
        except h.HTTPError as e:
            raise TransportError(self._kind(e), f"{type(e).__name__}: {e}"[:300]) from e

    async def request_json(self, method: str, path: str, body: dict | None = None):
        h = self._httpx
        try:
            resp = await self.client.request(method, path, json=body)
        except h.HTTPError as e:
            raise TransportError(self._kind(e), str(e)[:300]) from e
        try:
            return resp.status_code, resp.json()
        except ValueError:
            return resp.status_code, resp.text

    async def aclose(self) -> None:
        await self.client.aclose()


_EOL = re.compile(r"\r\n|\r|\n")


async def sse_lines(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Lines as SSE ends them (CR, LF or CRLF only). Not httpx's aiter_lines: it also breaks at
    U+0085, U+2028, U+2029 and other str.splitlines() separators, which a server may leave raw
    inside a JSON string (llama.cpp's JSON does), cutting one `data:` line in two."""
    buf = ""
    async for text in chunks:
        buf += text
        parts = _EOL.split(buf[:-1] if buf.endswith("\r") else buf)  # a CR may start a CRLF
        keep = "\r" if buf.endswith("\r") else ""
        buf = parts.pop() + keep
        for line in parts:
            yield line
    if buf.rstrip("\r"):  # an unterminated last line (no EOL left in buf but a kept CR)
        yield buf.rstrip("\r")


def _parse(payload: str) -> dict:
    try:
        obj = json.loads(payload)
    except ValueError as e:
        raise TransportError("protocol", f"bad SSE payload: {payload[:120]!r}") from e
    if not isinstance(obj, dict):
        raise TransportError("protocol", f"SSE payload is not an object: {payload[:120]!r}")
    return obj
