"""Closed-loop load at one concurrency against /v1/completions, and the three phases.

Every request streams (include_usage) with token-id prompts, ignore_eos and temperature 0, so
its output length is exactly what was asked; TTFT is the first chunk with a choice (its text may
be empty: a partial UTF-8 character), ITL the time from it to the last one over the tokens after
the first. A level sends `rounds * concurrency` requests through
`concurrency` workers; its throughput is tokens over the level's wall time (first send to last
answer). Prompt token ids are drawn from the vocabulary above the special-token range, seeded:
prefill and combined prompts are unique per request (nothing cached, checked through
usage.prompt_tokens_details.cached_tokens), the decode phase's prompt is one prompt of the input
length sent once before the level, so every timed request finds it in the prefix cache.

Invariants: a failed request is counted in `errors` and contributes no tokens; every request has
a timeout (the transport's); a phase stops at the first saturated level (model.saturated).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from loomserve.bench.metrics import pct
from loomserve.bench.pd_profile.model import concurrency_levels, saturated
from loomserve.bench.prompts import token_id_range
from loomserve.bench.replay.transport import HttpxTransport, TransportError

__all__ = ["Level", "Workload", "Profiler"]


@dataclass
class Workload:
    input_len: int          # prompt tokens of a request
    output_len: int         # generated tokens of a request
    input_new: int | None = None  # uncached prompt tokens per request (traces); None: input_len

    @property
    def prefill_len(self) -> int:
        return self.input_len if self.input_new is None else self.input_new


@dataclass
class Level:
    phase: str              # prefill | decode | combined
    concurrency: int
    requests: int
    errors: int = 0
    wall_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: dict = field(default_factory=dict)
    itl_ms: dict = field(default_factory=dict)
    error_kinds: list[str] = field(default_factory=list)

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens computed (not served from the cache) per second."""
        return (self.prompt_tokens - self.cached_tokens) / self.wall_s if self.wall_s else 0.0

    @property
    def decode_tps(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def rps(self) -> float:
        return (self.requests - self.errors) / self.wall_s if self.wall_s else 0.0

    def rate(self) -> float:
        """The phase's own throughput: prefill tokens/s for prefill, generated tokens/s else."""
        return self.prefill_tps if self.phase == "prefill" else self.decode_tps

    def to_dict(self) -> dict:
        return {**asdict(self), "prefill_tps": self.prefill_tps, "decode_tps": self.decode_tps,
                "rps": self.rps}


@dataclass
class _Sample:
    ok: bool
    ttft: float | None = None
    itl: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""


async def _one(transport: HttpxTransport, body: dict) -> _Sample:
    t0 = time.perf_counter()
    times: list[float] = []
    usage: dict = {}
    try:
        async for chunk in transport.stream(body, {}):
            if chunk.get("error"):
                return _Sample(False, error="stream_error")
            if chunk.get("choices"):  # a token's chunk (its text may be "": a partial char)
                times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    except TransportError as e:
        return _Sample(False, error=e.kind)
    if not times or not usage:
        return _Sample(False, error="empty")
    n = int(usage.get("completion_tokens") or 0)
    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    itl = (times[-1] - times[0]) / (n - 1) if n > 1 else None
    return _Sample(True, times[0] - t0, itl, int(usage.get("prompt_tokens") or 0), cached, n)


class Profiler:
    """Runs the phases against live instances. `log` gets one progress line per level."""

    def __init__(self, workload: Workload, vocab_size: int, model: str | None = None,
                 rounds: int = 3, gain: float = 0.05, seed: int = 0,
                 request_timeout: float = 600.0, api_key: str | None = None,
                 log=lambda s: print(s, file=sys.stderr, flush=True)) -> None:
        self.w, self.model, self.rounds, self.gain = workload, model, rounds, gain
        self.lo, self.hi = token_id_range(vocab_size)
        self.rng = random.Random(seed)
        self.timeout, self.api_key, self.log = request_timeout, api_key, log

    def _prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(self.lo, self.hi) for _ in range(n)]

    def _body(self, prompt: list[int], max_tokens: int) -> dict:
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        return body

    async def _level(self, url: str, phase: str, concurrency: int, bodies: list[dict]) -> Level:
        transport = HttpxTransport(url, pool=concurrency, request_timeout=self.timeout,
                                   api_key=self.api_key)
        queue: asyncio.Queue = asyncio.Queue()
        for b in bodies:
            queue.put_nowait(b)
        samples: list[_Sample] = []

        async def worker():
            while not queue.empty():
                samples.append(await _one(transport, queue.get_nowait()))

        try:
            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            wall = time.perf_counter() - t0
        finally:
            await transport.aclose()
        ok = [s for s in samples if s.ok]
        return Level(phase, concurrency, len(bodies), len(samples) - len(ok), wall,
                     sum(s.prompt_tokens for s in ok), sum(s.cached_tokens for s in ok),
                     sum(s.completion_tokens for s in ok),
                     _ms(s.ttft for s in ok), _ms(s.itl for s in ok if s.itl is not None),
                     sorted({s.error for s in samples if not s.ok}))

    async def _warm(self, url: str, prompt: list[int]) -> None:
        """One untimed request: loads the model's lazy paths and, for decode, caches `prompt`."""
        lvl = await self._level(url, "warmup", 1, [self._body(prompt, 2)])
        if lvl.errors:
            raise RuntimeError(f"warm-up request to {url} failed: {', '.join(lvl.error_kinds)}")

    async def phase(self, url: str, phase: str, max_concurrency: int,
                    stop_at_saturation: bool = True) -> list[Level]:
        """Levels of one phase, in order; stops at the first saturated level when asked."""
        w = self.w
        shared = self._prompt(w.input_len) if phase == "decode" else None
        await self._warm(url, shared or self._prompt(min(w.input_len, 64)))
        levels: list[Level] = []
        for c in concurrency_levels(max_concurrency):
            n = max(1, self.rounds) * c
            if phase == "prefill":
                bodies = [self._body(self._prompt(w.prefill_len), 1) for _ in range(n)]
            elif phase == "decode":
                bodies = [self._body(list(shared), w.output_len) for _ in range(n)]
            else:
                bodies = [self._body(self._prompt(w.input_len), w.output_len) for _ in range(n)]
            lvl = await self._level(url, phase, c, bodies)
            self.log(f"pd-profile: {phase} c={c}: {lvl.rate():.1f} tok/s, "
                     f"ttft p50 {lvl.ttft_ms.get('p50')} ms, errors {lvl.errors}")
            best = max((x.rate() for x in levels), default=None)
            levels.append(lvl)
            if lvl.errors == lvl.requests:
                raise RuntimeError(f"every {phase} request at concurrency {c} failed: "
                                   f"{', '.join(lvl.error_kinds)}")
            if stop_at_saturation and best is not None and saturated(best, lvl.rate(), self.gain):
                break
        return levels


def _ms(values) -> dict:
    return {k: (round(v * 1000, 2) if isinstance(v, float) and k != "count" else v)
            for k, v in pct(values).items()}
