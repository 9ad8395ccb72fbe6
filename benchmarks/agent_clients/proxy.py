"""A recording reverse proxy: what an agent client sends to loomserve and what it gets back.

Every request is forwarded unchanged to the upstream server (streams pass through chunk by
chunk); one JSON line per request goes to the log: the client label, method, path, status,
the request's JSON body, and the response body when the status is not 2xx (the error a client
saw). The label is whatever `set_label` last named, so one proxy serves clients run in turn.

    python benchmarks/agent_clients/proxy.py --upstream http://127.0.0.1:8000 --port 8100 \
        --log /tmp/agent-clients/requests.jsonl
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding"}


class Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self.label = "-"
        self.lock = threading.Lock()
        self.count = 0  # lines written: a stream's end names its request's line

    def set_label(self, label: str) -> None:
        self.label = label

    def write(self, entry: dict) -> int:
        """Append one line; its number (1-based)."""
        with self.lock, open(self.path, "a") as f:
            self.count += 1
            f.write(json.dumps({"client": self.label, "t": round(time.time(), 3), **entry}) + "\n")
            return self.count


def build_proxy(upstream: str, recorder: Recorder) -> Starlette:
    # No read limit: a CPU prefills a 20K-token agent prompt for minutes before the first byte,
    # and the client behind the proxy has its own timeout.
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(600.0, read=None))

    async def forward(request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        req = client.build_request(request.method, request.url.path, params=request.query_params,
                                   headers=headers, content=body)
        resp = await client.send(req, stream=True)
        entry = {"method": request.method, "path": request.url.path, "status": resp.status_code,
                 "request": _json_or_text(body),
                 "headers": {k: v for k, v in headers.items()
                             if k.lower() not in ("authorization", "x-api-key")}}
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS
                       and k.lower() != "content-encoding"}
        if resp.status_code >= 300 or "text/event-stream" not in resp.headers.get("content-type", ""):
            content = await resp.aread()
            await resp.aclose()
            if resp.status_code >= 300:
                entry["response"] = _json_or_text(content)
            recorder.write(entry)
            return Response(content, status_code=resp.status_code, headers=out_headers)

        seq = recorder.write(entry)  # now: a client killed mid-stream still leaves its request

        async def relay():
            tail = b""
            try:
                async for chunk in resp.aiter_raw():
                    tail = (tail + chunk)[-2000:]
                    yield chunk
            finally:
                await resp.aclose()
                recorder.write({"stream_end_of": seq, "stream_tail": tail.decode(errors="replace")})

        return StreamingResponse(relay(), status_code=resp.status_code, headers=out_headers)

    return Starlette(routes=[Route("/{path:path}", forward,
                                   methods=["GET", "POST", "DELETE", "PUT", "HEAD", "OPTIONS"])])


def _json_or_text(body: bytes):
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body[:2000].decode(errors="replace")


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True)
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--log", required=True)
    args = p.parse_args()
    uvicorn.run(build_proxy(args.upstream, Recorder(args.log)), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
