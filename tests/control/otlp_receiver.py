"""An OTLP/HTTP traces receiver for tests: a tiny HTTP server decoding the
ExportTraceServiceRequest protobufs the instances' and the router's exporters POST, keeping
every span flattened to a dict (service, name, trace, id, parent, links, times, attrs)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_service


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP traces endpoint: every span received, flattened to a dict."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        req = trace_service.ExportTraceServiceRequest.FromString(body)
        spans = []
        for rs in req.resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append({
                        "service": service.get("service.name"), "name": s.name,
                        "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex(), "kind": s.kind,
                        "links": [(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links],
                        "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                        "attrs": {a.key: _value(a.value) for a in s.attributes}})
        with self.server.lock:
            self.server.spans.extend(spans)
        out = trace_service.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def start_receiver() -> Receiver:
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    return receiver
