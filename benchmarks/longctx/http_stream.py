"""A lean streaming HTTP/1.1 POST over asyncio streams, for timing servers' SSE per token.

Why not httpx: on the 2-vCPU benchmark hosts the client shares the CPUs with the server it
times, and httpx's streaming path (httpcore, h11, anyio, text decoding) cost about 0.3 ms of CPU
per streamed token there, as much as the server's own API layer: every system measured was
slowed by it. This client reads the socket with asyncio's StreamReader, undoes the chunked
transfer coding by hand, and hands text to the SSE line splitter (`sse_lines`), ~5x less
CPU per token.

Invariants:
- one connection per request, `Connection: close`; the body is read to its end (the last
  chunk, or EOF without chunking).
- a non-200 status raises `HttpError` with the start of the body; a malformed response (bad
  status line, bad chunk size, EOF mid-chunk) raises `HttpError` too, never yields garbage.
"""

from __future__ import annotations

import asyncio
import codecs
import json
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

__all__ = ["HttpError", "post_stream"]

_READ = 1 << 16


class HttpError(Exception):
    pass


def _request(url: str, body: dict[str, Any]) -> tuple[str, int, bytes]:
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise HttpError(f"only http://host:port URLs, not {url!r}")
    port = u.port or 80
    payload = json.dumps(body).encode()
    head = (f"POST {u.path or '/'} HTTP/1.1\r\nHost: {u.hostname}:{port}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    return u.hostname, port, head.encode() + payload


async def _headers(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
        raise HttpError(f"bad response head: {e}") from e
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise HttpError(f"bad status line {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return int(parts[1]), headers


async def _chunks(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive (chunked transfer coding removed)."""
    if not chunked:
        while data := await reader.read(_READ):
            yield data
        return
    try:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip() or b"x", 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            if await reader.readexactly(2) != b"\r\n":
                raise HttpError("chunk not followed by CRLF")
    except (asyncio.IncompleteReadError, ValueError) as e:
        raise HttpError(f"malformed chunked body: {e}") from e


async def post_stream(url: str, body: dict[str, Any]) -> AsyncIterator[str]:
    """POST `body` as JSON to `url`; yield the response body as text, piece by piece as it
    arrives (UTF-8 decoded across piece boundaries). No timeout of its own: the caller bounds
    the whole request (measure.py: asyncio.timeout around it)."""
    host, port, request = _request(url, body)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        await writer.drain()
        status, headers = await _headers(reader)
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if status != 200:
            text = b"".join([c async for c in _chunks(reader, chunked)])
            raise HttpError(f"HTTP {status}: {text[:300]!r}")
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        async for data in _chunks(reader, chunked):
            if text := decoder.decode(data):
                yield text
    finally:
        writer.close()
