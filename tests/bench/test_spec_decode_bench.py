"""benchmarks/spec_decode.py's none-vs-none baseline: the staggered cache-filling pass sends
its streams apart (so their prefill chunks differ), and texts are compared stream by stream."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)


class _Completions(BaseHTTPRequestHandler):
    """A /v1/completions that notes each request's arrival and streams its prompt back."""
    arrivals: list[tuple[float, str]] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.arrivals.append((time.monotonic(), body["prompt"]))
        chunk = json.dumps({"choices": [{"text": body["prompt"].upper()}]})
        out = f"data: {chunk}\n\ndata: [DONE]\n\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def _serve():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_staggered_send_spaces_the_streams_and_keeps_their_order():
    import spec_decode

    server, url = _serve()
    try:
        _Completions.arrivals = []
        prompts = ["a", "b", "c"]
        got = asyncio.run(spec_decode._send(url, prompts, 1, [None] * 3, "m", stagger_s=0.5))
        assert [r.text for r in got] == ["A", "B", "C"] and not any(r.error for r in got)
        # in order, ~0.5 s apart (margins: a client's setup may delay a request on a busy host)
        assert [p for _, p in sorted(_Completions.arrivals)] == prompts
        t = [a for a, _ in sorted(_Completions.arrivals)]
        assert t[2] - t[0] >= 0.6
        _Completions.arrivals = []
        asyncio.run(spec_decode._send(url, prompts, 1, [None] * 3, "m"))
        t = [a for a, _ in _Completions.arrivals]
        assert len(t) == 3 and max(t) - min(t) < 0.6  # unstaggered: all at once
    finally:
        server.shutdown()


def test_texts_are_compared_stream_by_stream():
    import spec_decode

    from benchmarks.report import _text_diff

    assert spec_decode.spec_config("none-staggered", 4) is None  # the baseline drafts nothing
    base = [{"text_sha": ["a", "b", "c"]}, {"text_sha": ["d"]}]
    other = [{"text_sha": ["a", "x", "c"]}, {"text_sha": ["y"]}]
    assert spec_decode.text_diff(other, base) == "2/4"
    assert spec_decode.text_diff(base, base) == "0/4"
    assert _text_diff(other, base) == "DIFFERS in 2 of 4 streams"
    assert _text_diff(base, base) == "identical"
    row = {"tok_per_s": 10.0, "acceptance_length": None}
    systems = {"none": {"rounds": {"edit/8": {**row, "runs": base}}},
               "none-staggered": {"rounds": {"edit/8": {**row, "runs": other}}}}
    table = spec_decode.table(systems)
    assert "none-staggered" in table and "2/4" in table
