"""A recording reverse proxy: what an agent client sends to loomserve and what it gets back.

Every request is forwarded unchanged to the upstream server (streams pass through chunk by
chunk); one JSON line per request goes to the log: the client label, method, path, status,
the request's JSON body, the response body when the status is not 2xx (the error a client
saw; a request the client gave up on before the first byte has status null and `error`), and
the response's id and usage (`response_id`, `usage`: of a stream, on its end line; the id is
the server's request id, the usage holds its `miss_causes`). With `max_output`, a generation
request asking for more output tokens (or naming no limit: Codex sends none, and a small model
may then write to the end of the context) is forwarded with that cap; the log keeps the body
the client sent and notes `output_capped`. The label is whatever `set_label` last named, so
one proxy serves clients run in turn.

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


OUTPUT_FIELDS = {"/v1/messages": "max_tokens", "/v1/responses": "max_output_tokens",
                 "/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens"}


def cap_output(path: str, body: bytes, cap: int | None) -> tuple[bytes, dict | None]:
    """The body with its output limit lowered to cap (set when absent); what was changed."""
    field = OUTPUT_FIELDS.get(path)
    if cap is None or field is None:
        return body, None
    try:
        req = json.loads(body)
    except ValueError:
        return body, None
    if not isinstance(req, dict):
        return body, None
    if path == "/v1/chat/completions" and "max_completion_tokens" in req:
        field = "max_completion_tokens"
    if isinstance(req.get(field), int) and req[field] <= cap:
        return body, None
    changed = {field: [req.get(field), cap]}
    return json.dumps({**req, field: cap}).encode(), changed


def build_proxy(upstream: str, recorder: Recorder, max_output: int | None = None) -> Starlette:
    # No read limit: a CPU prefills a 20K-token agent prompt for minutes before the first byte,
    # and the client behind the proxy has its own timeout.
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(600.0, read=None))

    async def forward(request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        sent, capped = (cap_output(request.url.path, body, max_output)
                        if request.method == "POST" else (body, None))
        req = client.build_request(request.method, request.url.path, params=request.query_params,
                                   headers=headers, content=sent)
        entry = {"method": request.method, "path": request.url.path, "status": None,
                 "request": _json_or_text(body),
                 "headers": {k: v for k, v in headers.items()
                             if k.lower() not in ("authorization", "x-api-key")}}
        if capped:
            entry["output_capped"] = capped
        try:
            resp = await client.send(req, stream=True)
        except BaseException as e:  # the client gave up before the first byte (or upstream
            # failed): the request was still sent, and a recording must hold it
            recorder.write({**entry, "error": type(e).__name__})
            raise
        entry["status"] = resp.status_code
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS
                       and k.lower() != "content-encoding"}
        if resp.status_code >= 300 or "text/event-stream" not in resp.headers.get("content-type", ""):
            content = await resp.aread()
            await resp.aclose()
            if resp.status_code >= 300:
                entry["response"] = _json_or_text(content)
            else:
                entry.update(_id_and_usage([_json_or_text(content)]))
            recorder.write(entry)
            return Response(content, status_code=resp.status_code, headers=out_headers)

        seq = recorder.write(entry)  # now: a client killed mid-stream still leaves its request

        async def relay():
            body = bytearray()
            try:
                async for chunk in resp.aiter_raw():
                    if len(body) < STREAM_KEEP:
                        body += chunk
                    yield chunk
            finally:
                await resp.aclose()
                text = body.decode(errors="replace")
                recorder.write({"stream_end_of": seq, "stream_tail": text[-2000:],
                                **_id_and_usage(_sse_events(text))})

        return StreamingResponse(relay(), status_code=resp.status_code, headers=out_headers)

    return Starlette(routes=[Route("/{path:path}", forward,
                                   methods=["GET", "POST", "DELETE", "PUT", "HEAD", "OPTIONS"])])


STREAM_KEEP = 4 << 20  # bytes of a stream kept to find its id and usage (outputs are short)


def _sse_events(text: str) -> list:
    """The JSON payloads of an SSE stream's `data:` lines."""
    out = []
    for line in text.splitlines():
        if line.startswith("data:"):
            try:
                out.append(json.loads(line[5:]))
            except ValueError:
                continue  # [DONE], or a line cut at STREAM_KEEP
    return out


def _id_and_usage(events: list) -> dict:
    """The response id (first seen) and its usage (the events' usage objects merged in order:
    Messages streams split it between message_start and message_delta) across a body's events;
    at the top level, or under `message` / `response` (Messages and Responses stream events)."""
    rid, usage = None, {}
    for ev in events:
        if not isinstance(ev, dict):
            continue
        for obj in (ev, ev.get("message"), ev.get("response")):
            if isinstance(obj, dict):
                if rid is None and isinstance(obj.get("id"), str):
                    rid = obj["id"]
                if isinstance(obj.get("usage"), dict):
                    usage.update(obj["usage"])
    return {"response_id": rid, "usage": usage or None}


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
    p.add_argument("--max-output", type=int, default=None,
                   help="cap on each generation request's output tokens")
    args = p.parse_args()
    uvicorn.run(build_proxy(args.upstream, Recorder(args.log), args.max_output),
                host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
