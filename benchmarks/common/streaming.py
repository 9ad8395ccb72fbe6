"""A timing client for OpenAI-style streaming /v1/completions, and the decode-rate arithmetic.

`run_concurrent_streams` sends every body at once (one connection each) and stamps each
token-bearing SSE chunk on the client's monotonic clock; `decode_rate` turns one such round into
aggregate decode tokens/s.

Invariants: a failed stream is reported in its `StreamResult.error`, never raised; decode
tokens = sum over streams of (tokens - 1) (the first token comes from the prefill) over the
window from the earliest first token to the latest last token, so late starters make the
figure conservative.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from loomserve.bench.replay.transport import sse_lines

__all__ = ["StreamResult", "stream_completion", "run_concurrent_streams", "DecodeMeasurement",
           "decode_rate"]


@dataclass
class StreamResult:
    """One streamed completion, timed on the client's monotonic clock."""
    t_sent: float
    t_first: float | None = None  # first chunk that carried text
    t_last: float | None = None  # last chunk that carried text
    text_chunks: int = 0
    completion_tokens: int | None = None  # from the usage chunk, when the server sends one
    text: str = ""
    error: str | None = None

    @property
    def n_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.text_chunks


async def stream_completion(client: Any, url: str, body: dict[str, Any]) -> StreamResult:
    """POST ``body`` (with stream=true) and time the SSE chunks."""
    res = StreamResult(t_sent=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}"
                return res
            async for line in sse_lines(resp.aiter_text()):  # CR/LF only, as SSE
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    res.completion_tokens = int(usage["completion_tokens"])
                for choice in chunk.get("choices") or []:
                    piece = choice.get("text")
                    if piece is None:  # chat-style delta, just in case
                        piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        res.text_chunks += 1
                        res.text += piece
                        if res.t_first is None:
                            res.t_first = now
                        res.t_last = now
    except Exception as e:  # noqa: BLE001 - a failed stream is reported, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_concurrent_streams(base_url: str, bodies: Sequence[dict[str, Any]],
                                 path: str = "/v1/completions",
                                 timeout: float = 900.0) -> list[StreamResult]:
    """Send all ``bodies`` at once (one connection each) and gather their timings."""
    import httpx

    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout),
                                 limits=limits) as client:
        return list(await asyncio.gather(*(stream_completion(client, path, b) for b in bodies)))


@dataclass
class DecodeMeasurement:
    """Aggregate decode rate of one concurrent round.

    decode tokens = sum over streams of (tokens - 1): the first token of each stream comes
    from its prefill. Window = from the earliest first token to the latest last token.
    Streams that start late make this conservative (their prefill sits inside the window).
    """
    concurrency: int
    decode_tokens: int
    window_s: float
    tok_per_s: float
    total_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def decode_rate(results: Sequence[StreamResult]) -> DecodeMeasurement:
    ok = [r for r in results if r.error is None and r.t_first is not None]
    errors = [r.error or "no tokens" for r in results if r not in ok]
    if not ok:
        return DecodeMeasurement(len(results), 0, float("nan"), float("nan"), 0, [], errors)
    t0 = min(r.t_first for r in ok)
    t1 = max(r.t_last for r in ok)
    decode_tokens = sum(max(r.n_tokens - 1, 0) for r in ok)
    window = t1 - t0
    return DecodeMeasurement(
        concurrency=len(results), decode_tokens=decode_tokens, window_s=window,
        tok_per_s=decode_tokens / window if window > 0 else float("nan"),
        total_tokens=sum(r.n_tokens for r in ok),
        ttft_s=[round(r.t_first - r.t_sent, 4) for r in ok], errors=errors)
