"""`loomserve bench agentx`: closed-loop replay of agentic traces against an OpenAI-compatible
endpoint (see shared AGENTX.md for the rules).

- Concurrency N = N live session trees. Each slot replays one trace (main agent + subagent
  groups); when it ends the slot starts the next trace (cycling) from turn 0 with a fresh
  session marker, so no two replays share cache.
- Timing: an agent's next request goes out max(0, t_k - t_(k-1) - api_time_(k-1)) * time_scale
  after the LIVE end of its previous request (think_time when api_time is missing). A subagent's
  first request is timed from its parent turn's end the same way; a parent turn after a joined
  group also waits for the group and for the recorded gap after the group's end. Whenever
  nothing at all is in flight, every pending timer is pulled in by the same amount so that the
  next request goes out within `pull_in_s` (10 s) of the moment the system went idle.
- Warm start: each slot starts at a random turn k>=1 of its first trace and first sends a
  one-token primer of turn k-1 (same prompt); primers are recorded but excluded from metrics.
- Prompts: see prompts.py. Token-id prompts when the server accepts them (probed), else text.
- Streaming always, include_usage, ignore_eos, max_tokens = recorded out (capped); temperature
  only when asked (--temperature 0 for greedy outputs that can be compared across servers).
- Served hit rate by source: where the server exports
  loomserve_prefix_cache_hit_tokens_by_source_total (loomserve does; llama-server and vLLM do
  not), its /metrics is scraped before the first and after the last request and the delta is
  reported per source (metrics.py); elsewhere the split is simply absent.

The HTTP layer sits behind `Transport` and time behind `Clock`, so tests run the whole replay on
a fake clock against an in-process fake server.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import random
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from loomserve.bench.metrics import DEFAULT_PRICES, RequestRecord, compute_metrics
from loomserve.bench.prompts import PrefixTracker, PromptBuilder, ids_to_text, token_id_range

__all__ = ["Clock", "RealClock", "Transport", "TransportError", "HttpxTransport", "Pacer",
           "Replayer", "ServerInfo", "probe_server", "add_arguments", "main", "run_replay",
           "parse_hit_tokens_by_source", "scrape_hit_tokens_by_source", "counter_delta"]


# --------------------------------------------------------------------------- clock / transport

class Clock(Protocol):
    def now(self) -> float: ...
    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


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
                async for line in resp.aiter_lines():
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


def _parse(payload: str) -> dict:
    try:
        obj = json.loads(payload)
    except ValueError as e:
        raise TransportError("protocol", f"bad SSE payload: {payload[:120]!r}") from e
    if not isinstance(obj, dict):
        raise TransportError("protocol", f"SSE payload is not an object: {payload[:120]!r}")
    return obj


# --------------------------------------------------------------------------- pacer

class Pacer:
    """Send timers plus the in-flight count; pulls timers in when nothing is in flight."""

    def __init__(self, clock: Clock, pull_in_s: float = 10.0) -> None:
        self.clock = clock
        self.pull_in_s = pull_in_s
        self.inflight = 0
        self.idle_since = clock.now()
        self.pulled_in_s = 0.0
        self.closed = False
        self._heap: list[list] = []
        self._seq = 0
        self._wake = asyncio.Event()

    async def wait_until(self, deadline: float) -> bool:
        """Wait for `deadline` (maybe pulled in). False once the pacer is closed."""
        if self.closed:
            return False
        if deadline <= self.clock.now():
            return True
        fut = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._heap, [deadline, self._seq, fut])
        self._wake.set()
        try:
            return await fut
        finally:
            if not fut.done():
                fut.cancel()

    def begin(self) -> None:
        self.inflight += 1
        self._wake.set()

    def end(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle_since = self.clock.now()
        self._wake.set()

    def close(self) -> None:
        self.closed = True
        for e in self._heap:
            if not e[2].done():
                e[2].set_result(False)
        self._heap.clear()
        self._wake.set()

    async def run(self) -> None:
        while not self.closed:
            self._wake.clear()
            now = self.clock.now()
            heap = self._heap
            while heap and (heap[0][2].done() or heap[0][0] <= now):
                e = heapq.heappop(heap)
                if not e[2].done():
                    e[2].set_result(True)
                    # the released agent is about to send: restart the idle window, so the
                    # next timer is not pulled in before that request is in flight
                    self.idle_since = max(self.idle_since, now)
            if not heap:
                await self._wake.wait()
                continue
            target = earliest = heap[0][0]
            if self.inflight == 0:
                limit = self.idle_since + self.pull_in_s
                if now >= limit:  # idle for pull_in_s: pull every timer in by the same amount
                    shift = earliest - now
                    for e in heap:  # a uniform shift keeps the heap order
                        e[0] -= shift
                    self.pulled_in_s += shift
                    continue
                target = min(earliest, limit)
            sleeper = asyncio.ensure_future(self.clock.sleep(target - now))
            waker = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sleeper.cancel()
                waker.cancel()


# --------------------------------------------------------------------------- replayer

@dataclass
class _Replay:
    id: str
    scope: str
    block_size: int
    slot: int
    trace: str
    tracker: PrefixTracker = field(default_factory=PrefixTracker)


def _attr(obj, name, default=None):
    return getattr(obj, name, default)


class Replayer:
    def __init__(self, sessions, *, transport: Transport, clock: Clock, builder: PromptBuilder,
                 model: str | None, concurrency: int, duration: float, time_scale: float = 1.0,
                 max_context: int | None = None, max_output: int | None = None,
                 scale_output: bool = False, warmup: bool = True, seed: int | None = None,
                 mode: str = "ids", pull_in_s: float = 10.0, drain_timeout_s: float = 60.0,
                 error_backoff_s: float = 1.0, run_nonce: str | None = None,
                 on_record=None, text_ratio: float = 1.0, keep_prompts: bool = False,
                 keep_outputs: bool = False, temperature: float | None = None) -> None:
        self.keep_prompts = keep_prompts  # token ids of each sent prompt, for offline re-play
        self.keep_outputs = keep_outputs  # each request's streamed text, to compare outputs
        self.temperature = temperature    # None: the server's default
        self.sessions = [s for s in sessions if s.main]
        if not self.sessions:
            raise ValueError("no trace with a main-agent request to replay")
        self.transport = transport
        self.clock = clock
        self.builder = builder
        self.model = model
        self.concurrency = concurrency
        self.duration = duration
        self.time_scale = time_scale
        self.max_context = max_context
        self.max_output = max_output
        self.scale_output = scale_output
        self.warmup = warmup
        self.rng = random.Random(seed)
        self.mode = mode
        self.drain_timeout_s = drain_timeout_s
        self.error_backoff_s = error_backoff_s
        self.nonce = run_nonce or os.urandom(4).hex()
        self.on_record = on_record
        self.text_ratio = text_ratio
        self.pacer = Pacer(clock, pull_in_s)
        self.records: list[RequestRecord] = []
        self.stopping = False
        self.interrupted = False
        self._interrupt = asyncio.Event()
        self._cursor = concurrency
        self._replays = 0
        self.t0 = 0.0

    # -- public
    def interrupt(self) -> None:
        self.interrupted = True
        self._interrupt.set()

    def now(self) -> float:
        return self.clock.now() - self.t0

    async def run(self) -> list[RequestRecord]:
        self.t0 = self.clock.now()
        self.pacer.idle_since = self.t0
        pacer_task = asyncio.ensure_future(self.pacer.run())
        self._warm_slots: set[int] = set()
        self._all_warm = asyncio.Event()
        slots = [asyncio.ensure_future(self._slot(i)) for i in range(self.concurrency)]
        intr = asyncio.ensure_future(self._interrupt.wait())
        all_done = asyncio.ensure_future(asyncio.wait(slots))
        # --duration counts measured traffic: the timer starts once every slot's primer is back,
        # as the reference harness does after its warm-up.
        warm = asyncio.ensure_future(self._all_warm.wait())
        timer = asyncio.ensure_future(self._after(warm, self.duration))
        try:
            await asyncio.wait({timer, intr, all_done}, return_when=asyncio.FIRST_COMPLETED)
            warm.cancel()
            self.stopping = True
            self.pacer.close()
            pending = [s for s in slots if not s.done()]
            if pending and not self.interrupted:
                drain = asyncio.ensure_future(self.clock.sleep(self.drain_timeout_s))
                gathered = asyncio.ensure_future(asyncio.wait(pending))
                await asyncio.wait({drain, gathered, intr}, return_when=asyncio.FIRST_COMPLETED)
                drain.cancel()
                gathered.cancel()
        finally:
            for t in (timer, intr, all_done, warm):
                t.cancel()
            for s in slots:
                s.cancel()
            await asyncio.gather(*slots, return_exceptions=True)
            self.pacer.close()
            pacer_task.cancel()
            await asyncio.gather(pacer_task, return_exceptions=True)
        for s in slots:
            if s.done() and not s.cancelled() and s.exception() is not None:
                raise s.exception()
        return self.records

    async def _after(self, event: asyncio.Future, seconds: float) -> None:
        await event
        await self.clock.sleep(seconds)

    def _mark_warm(self, slot: int) -> None:
        self._warm_slots.add(slot)
        if len(self._warm_slots) >= self.concurrency:
            self._all_warm.set()

    # -- slots and sessions
    def _next_session(self, slot: int, first: bool):
        if first:
            return self.sessions[slot % len(self.sessions)]
        s = self.sessions[self._cursor % len(self.sessions)]
        self._cursor += 1
        return s

    async def _slot(self, slot: int) -> None:
        first = True
        while not self.stopping:
            session = self._next_session(slot, first)
            await self._replay_session(slot, session, warm=first and self.warmup)
            first = False
            await asyncio.sleep(0)

    async def _replay_session(self, slot: int, session, warm: bool) -> None:
        self._replays += 1
        scope = "global" if _attr(session, "hash_id_scope", "local") == "global" else session.id
        ctx = _Replay(id=f"agentx-{self.nonce}-{slot}-{self._replays}", scope=scope,
                      block_size=session.block_size or 64, slot=slot, trace=session.id)
        main = session.main
        start = self.rng.randrange(1, len(main)) if warm and len(main) > 1 else 0
        after: dict[int, list] = {}
        for g in session.groups:
            after.setdefault(g.after_index, []).append(g)
        tasks: list[asyncio.Future] = []
        joined: list[asyncio.Future] = []

        def spawn(index: int, parent_req, parent_end: float) -> None:
            for g in after.get(index, ()):
                t = asyncio.ensure_future(self._run_group(ctx, g, parent_req, parent_end))
                tasks.append(t)
                if g.joined:
                    joined.append(t)

        try:
            await self._main_agent(ctx, main, start, spawn, joined)
            if tasks:  # the session ends when its subagents do (they stop by themselves too)
                await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _main_agent(self, ctx: _Replay, main, start: int, spawn, joined) -> None:
        prev_req, prev_end = None, self.now()
        if start > 0:
            prev_req = main[start - 1]
            primed = await self._send(ctx, prev_req, None, start - 1, primer=True)
            self._mark_warm(ctx.slot)
            if primed is None:
                return
            prev_end = self.now()
            spawn(start - 1, prev_req, prev_end)
        else:
            self._mark_warm(ctx.slot)
            spawn(-1, None, prev_end)
        for i in range(start, len(main)):
            req = main[i]
            send_at = prev_end + (self._gap(prev_req.t, prev_req.api_time, req)
                                  if prev_req is not None else 0.0)
            while joined:
                live_end, rec_end = await joined.pop(0)
                send_at = max(send_at, live_end + max(0.0, req.t - rec_end) * self.time_scale)
            if self.stopping or not await self.pacer.wait_until(send_at + self.t0):
                return
            if await self._send(ctx, req, None, i) is None:
                return
            prev_req, prev_end = req, self.now()
            spawn(i, req, prev_end)

    def _gap(self, prev_t: float, prev_api: float | None, req) -> float:
        if prev_api is not None:
            g = req.t - prev_t - prev_api
        else:
            tt = _attr(req, "think_time", 0.0) or 0.0
            g = tt if tt > 0 else req.t - prev_t
        return max(0.0, g) * self.time_scale

    async def _run_group(self, ctx: _Replay, group, parent_req, parent_end: float):
        results = await asyncio.gather(*(self._run_subagent(ctx, sub, parent_req, parent_end)
                                         for sub in group.subagents))
        rec_end = max(results) if results else (parent_req.t if parent_req else 0.0)
        return self.now(), rec_end

    async def _run_subagent(self, ctx: _Replay, sub, parent_req, parent_end: float) -> float:
        """Replay one subagent; returns its recorded end time (session time)."""
        reqs = sub.requests
        if not reqs:
            dur = _attr(sub, "duration_ms") or 0.0
            return sub.t + dur / 1000.0
        if parent_req is not None:
            prev_t, prev_api = parent_req.t, parent_req.api_time
        else:
            prev_t, prev_api = sub.t, 0.0
        prev_end = parent_end
        for j, req in enumerate(reqs):
            send_at = prev_end + self._gap(prev_t, prev_api, req)
            if self.stopping or not await self.pacer.wait_until(send_at + self.t0):
                break
            if await self._send(ctx, req, sub.agent_id, j) is None:
                break
            prev_t, prev_api, prev_end = req.t, req.api_time, self.now()
        last = reqs[-1]
        return last.t + (last.api_time or 0.0)

    # -- one request
    def max_tokens_for(self, req, block_size: int) -> int:
        out = req.out_tokens
        if self.scale_output:
            out = round(out * self.builder.block_tokens / block_size)
        out = max(1, out)
        if self.max_output:
            out = min(out, self.max_output)
        if self.max_context:
            out = max(1, min(out, self.max_context // 2))
        return out

    async def _send(self, ctx: _Replay, req, sub_agent: str | None, turn: int,
                    primer: bool = False) -> RequestRecord | None:
        if self.stopping:
            return None
        max_tokens = self.max_tokens_for(req, ctx.block_size)
        cap = self.max_context - max_tokens if self.max_context else None
        if cap is not None and self.mode == "text" and self.text_ratio > 1:
            cap = max(1, int(cap / self.text_ratio))  # words that tokenize to several tokens
        agent = sub_agent or "main"
        prompt = self.builder.build(ctx.scope, ctx.id, req.hash_ids, req.in_tokens,
                                    ctx.block_size, cap, pad_key=f"{agent}:{turn}")
        theo = ctx.tracker.observe(prompt.segments)
        body = {"prompt": prompt.tokens if self.mode == "ids" else ids_to_text(prompt.tokens),
                "max_tokens": 1 if primer else max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        if self.model:
            body["model"] = self.model
        if self.temperature is not None:
            body["temperature"] = self.temperature
        headers = {"X-Session-ID": ctx.id if sub_agent is None else f"{ctx.id}/{sub_agent}"}
        if sub_agent is not None:
            headers["X-Parent-Session-ID"] = ctx.id
        rec = RequestRecord(send_time=self.now(), intended_prompt_tokens=len(prompt),
                            theoretical_cached_tokens=theo, max_tokens=body["max_tokens"],
                            truncated=prompt.truncated, primer=primer, slot=ctx.slot,
                            session=headers["X-Session-ID"], trace=ctx.trace, agent=agent,
                            turn=turn, prompt_ids=list(prompt.tokens) if self.keep_prompts else None)
        self.pacer.begin()
        backoff = False
        texts: list[str] | None = [] if self.keep_outputs else None
        try:
            async for payload in self.transport.stream(body, headers):
                t = self.now()
                if "error" in payload and not payload.get("choices"):
                    err = payload["error"]
                    raise TransportError("stream_error",
                                         str(err.get("message") if isinstance(err, dict) else err))
                choices = payload.get("choices") or []
                if choices:
                    c = choices[0]
                    text = c.get("text")
                    if text is None:
                        text = (c.get("delta") or {}).get("content")
                    if text or c.get("finish_reason") is not None:
                        rec.chunk_times.append(t)
                    if texts is not None and text:
                        texts.append(text)
                usage = payload.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    rec.output_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens") or 0
            rec.end_time = self.now()
            if texts is not None:
                rec.output_text = "".join(texts)
            if rec.chunk_times:
                rec.first_token_time = rec.chunk_times[0]
            if rec.output_tokens is None:
                rec.output_tokens = len(rec.chunk_times)
        except TransportError as e:
            rec.error, rec.error_detail = e.kind, e.detail
            backoff = e.kind in ("connection", "timeout") or e.kind.startswith("http_5")
        except asyncio.CancelledError:
            rec.error = "cancelled"
            raise
        finally:
            self.pacer.end()
            self.records.append(rec)
            if self.on_record is not None:
                self.on_record(rec)
        if backoff and self.error_backoff_s > 0:
            await self.clock.sleep(self.error_backoff_s)
        return rec


# --------------------------------------------------------------------------- probing

@dataclass
class ServerInfo:
    model: str | None = None
    max_model_len: int | None = None
    vocab_size: int = 32000
    vocab_source: str = "default"
    mode: str = "ids"
    ids_prompt_tokens_delta: int | None = None   # usage.prompt_tokens - ids sent (ids mode)
    text_token_ratio: float | None = None        # usage.prompt_tokens / words (text mode)
    text_stable: bool | None = None
    notes: list[str] = field(default_factory=list)


_VOCAB_HINT = re.compile(r"\[0,\s*(\d+)\)")


async def probe_server(transport: Transport, model: str | None, vocab_size: int | None = None,
                       mode: str = "auto") -> ServerInfo:
    info = ServerInfo(model=model)
    try:
        status, models = await transport.request_json("GET", "/v1/models")
    except TransportError as e:
        raise RuntimeError(f"cannot reach the endpoint: {e}") from e
    card = None
    if status == 200 and isinstance(models, dict) and models.get("data"):
        data = models["data"]
        card = next((c for c in data if c.get("id") == model), data[0])
        if info.model is None:
            info.model = card.get("id")
        info.max_model_len = card.get("max_model_len") or card.get("context_length")
    if vocab_size:
        info.vocab_size, info.vocab_source = vocab_size, "option"
    elif card and card.get("vocab_size"):
        info.vocab_size, info.vocab_source = int(card["vocab_size"]), "models"

    async def try_ids(ids) -> tuple[bool, str, dict | None]:
        body = {"prompt": list(ids), "max_tokens": 1, "stream": False, "ignore_eos": True}
        if info.model:
            body["model"] = info.model
        st, resp = await transport.request_json("POST", "/v1/completions", body)
        return st == 200, (json.dumps(resp) if isinstance(resp, dict) else str(resp)), \
            (resp if isinstance(resp, dict) else None)

    if mode in ("auto", "ids"):
        lo, hi = token_id_range(info.vocab_size)
        ok, msg, resp = await try_ids([lo, lo + 1, hi - 1])
        if not ok and not vocab_size:
            m = _VOCAB_HINT.search(msg)
            if m and int(m.group(1)) >= 16:
                info.vocab_size, info.vocab_source = int(m.group(1)), "server error message"
                lo, hi = token_id_range(info.vocab_size)
                ok, msg, resp = await try_ids([lo, lo + 1, hi - 1])
            elif (await try_ids([10, 11, 12]))[0]:
                good, bad = 12, hi - 1  # largest accepted id by bisection
                while bad - good > 1:
                    mid = (good + bad) // 2
                    if (await try_ids([mid]))[0]:
                        good = mid
                    else:
                        bad = mid
                info.vocab_size, info.vocab_source = good + 1, "probed"
                lo, hi = token_id_range(info.vocab_size)
                ok, msg, resp = await try_ids([lo, lo + 1, hi - 1])
        if ok:
            info.mode = "ids"
            usage = (resp or {}).get("usage") or {}
            if usage.get("prompt_tokens") is not None:
                info.ids_prompt_tokens_delta = usage["prompt_tokens"] - 3
            return info
        if mode == "ids":
            raise RuntimeError(f"the server does not accept token-id prompts: {msg[:300]}")
        info.notes.append(f"token-id prompts rejected ({msg[:120]}); using text")
    info.mode = "text"
    n = 16
    lo, hi = token_id_range(info.vocab_size)
    ids = list(range(lo, lo + n))
    body = {"prompt": ids_to_text(ids), "max_tokens": 1, "stream": False}
    if info.model:
        body["model"] = info.model
    st, resp = await transport.request_json("POST", "/v1/completions", body)
    if st != 200 or not isinstance(resp, dict):
        raise RuntimeError(f"text probe failed: HTTP {st}: {str(resp)[:300]}")
    pt = ((resp.get("usage") or {}).get("prompt_tokens"))
    if pt is not None:
        info.text_token_ratio = pt / n
        info.text_stable = abs(pt - n) <= 2
        if not info.text_stable:
            info.notes.append(f"text prompts tokenize to {pt} tokens per {n} words: token "
                              "counts are approximate (the context cap is divided by the ratio)")
    return info


# --------------------------------------------------------------------------- /metrics scrape

HIT_SOURCE_METRIC = "loomserve_prefix_cache_hit_tokens_by_source"


def parse_hit_tokens_by_source(text: str) -> dict[str, float] | None:
    """Prompt tokens served from the prefix cache per source ({"device": .., "host": ..}), summed
    over model names, from Prometheus text; None when the metric is not there (not loomserve)
    or the text does not parse."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] | None = None
    try:
        for fam in text_string_to_metric_families(text):
            if fam.name != HIT_SOURCE_METRIC:
                continue
            for sample in fam.samples:
                source = sample.labels.get("source")
                if source is None or sample.name not in (HIT_SOURCE_METRIC + "_total",
                                                         HIT_SOURCE_METRIC):
                    continue  # e.g. a _created sample
                out = out if out is not None else {}
                out[source] = out.get(source, 0.0) + float(sample.value)
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    return out


async def scrape_hit_tokens_by_source(transport: Transport,
                                      urls: list[str] | None = None) -> dict[str, float] | None:
    """The hit-token counters of the endpoint's /metrics, or summed over `urls` (the instances
    behind a router: each URL is a server root or its /metrics). None when any scrape fails or
    lacks the metric."""
    texts: list[str] = []
    try:
        if not urls:
            status, body = await transport.request_json("GET", "/metrics")
            if status != 200 or not isinstance(body, str):
                return None
            texts.append(body)
        else:
            import httpx

            async with httpx.AsyncClient(timeout=10.0) as client:
                for url in urls:
                    url = url.rstrip("/")
                    resp = await client.get(url if url.endswith("/metrics") else url + "/metrics")
                    if resp.status_code != 200:
                        return None
                    texts.append(resp.text)
    except Exception:  # noqa: BLE001 - no metrics is not an error of the replay
        return None
    total: dict[str, float] = {}
    for text in texts:
        part = parse_hit_tokens_by_source(text)
        if part is None:
            return None
        for k, v in part.items():
            total[k] = total.get(k, 0.0) + v
    return total


def counter_delta(before: dict[str, float] | None,
                  after: dict[str, float] | None) -> dict[str, float] | None:
    """after - before per source; None when either is missing or a counter went back (the
    server restarted meanwhile)."""
    if before is None or after is None:
        return None
    out = {k: v - before.get(k, 0.0) for k, v in after.items()}
    if any(v < 0 for v in out.values()) or any(k not in after for k in before):
        return None
    return out


# --------------------------------------------------------------------------- CLI

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", required=True, help="server root URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--traces", required=True, nargs="+", help="trace files or directories")
    p.add_argument("--concurrency", type=int, default=4, help="live sessions (default: 4)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds to replay (default: 60)")
    p.add_argument("--scale", type=int, default=None,
                   help="tokens per trace block (default: the trace block size, i.e. unscaled)")
    p.add_argument("--scale-output", action="store_true", help="scale output tokens like inputs")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply recorded think gaps by this (default: 1)")
    p.add_argument("--max-context", type=int, default=None,
                   help="context cap (default: the server's max_model_len, else 2048)")
    p.add_argument("--max-output", type=int, default=None,
                   help="cap on max_tokens (default: 256 when the context cap is under 32K)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids stay below this (default: /v1/models or probed, else 32000)")
    p.add_argument("--prompt-mode", choices=("auto", "ids", "text"), default="auto",
                   help="token-id or text prompts (default: ids when the server accepts them)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="warm start: random start point plus a one-token primer (default: on)")
    p.add_argument("--seed", type=int, default=None, help="seed for the warm-start points")
    p.add_argument("--pull-in", type=float, default=10.0,
                   help="when nothing is in flight, send the next request within this many s")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="after --duration, wait this long for in-flight requests (default: 60)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--devices", type=int, default=1, help="accelerators behind the endpoint")
    p.add_argument("--device-price-per-hour", type=float, default=None,
                   help="$ per device-hour, for tokens per dollar")
    p.add_argument("--price-cached-input", type=float, default=DEFAULT_PRICES["cached_input"],
                   help="API price, $ per M cached input tokens (default: %(default)s)")
    p.add_argument("--price-input", type=float, default=DEFAULT_PRICES["uncached_input"],
                   help="API price, $ per M uncached input tokens (default: %(default)s)")
    p.add_argument("--price-output", type=float, default=DEFAULT_PRICES["output"],
                   help="API price, $ per M output tokens (default: %(default)s)")
    p.add_argument("--json-out", default=None, help="write the result JSON here")
    p.add_argument("--records", action="store_true", help="include per-request records in JSON")
    p.add_argument("--record-prompts", action="store_true",
                   help="with --records, also each prompt's token ids (ids mode), so the same "
                        "requests can be re-played offline through the KV manager")
    p.add_argument("--record-outputs", action="store_true",
                   help="with --records, also each request's output text")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature sent with every request (default: the server's; "
                        "0 makes outputs comparable across servers)")
    p.add_argument("--metrics-url", nargs="+", default=None,
                   help="scrape these servers' /metrics for the hit split by source instead of "
                        "the endpoint's (e.g. the instances behind a router)")
    p.add_argument("--plots", default=None, help="write PNG plots into this folder")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


async def _ticker(replayer: Replayer, bar, duration: float) -> None:
    while True:
        await asyncio.sleep(1.0)
        ok = sum(1 for r in replayer.records if r.ok and not r.primer)
        err = sum(1 for r in replayer.records if r.error and not r.primer)
        bar.n = min(duration, round(replayer.now(), 1))
        bar.set_postfix(ok=ok, err=err, inflight=replayer.pacer.inflight, refresh=False)
        bar.refresh()


async def run_replay(args, sessions, transport: Transport | None = None, on_record=None) -> dict:
    """Probe, replay and measure. on_record(record) is called as each request ends (tests use
    it to inject faults mid-replay)."""
    own = transport is None
    if own:
        transport = HttpxTransport(args.endpoint, pool=4 * args.concurrency,
                                   request_timeout=args.request_timeout, api_key=args.api_key)
    try:
        info = await probe_server(transport, args.model, args.vocab_size, args.prompt_mode)
        block_size = sessions[0].block_size or 64
        block_tokens = args.scale or block_size
        max_context = args.max_context or info.max_model_len or 2048
        max_output = args.max_output
        if max_output is None and max_context < 32768:
            max_output = 256
        builder = PromptBuilder(info.vocab_size, block_tokens)
        replayer = Replayer(
            sessions, transport=transport, clock=RealClock(), builder=builder, model=info.model,
            concurrency=args.concurrency, duration=args.duration, time_scale=args.time_scale,
            max_context=max_context, max_output=max_output, scale_output=args.scale_output,
            warmup=args.warmup, seed=args.seed, mode=info.mode, pull_in_s=args.pull_in,
            drain_timeout_s=args.drain_timeout, text_ratio=info.text_token_ratio or 1.0,
            keep_prompts=getattr(args, "record_prompts", False) and info.mode == "ids",
            keep_outputs=getattr(args, "record_outputs", False),
            temperature=getattr(args, "temperature", None), on_record=on_record)
        metrics_urls = getattr(args, "metrics_url", None)
        hits_before = await scrape_hit_tokens_by_source(transport, metrics_urls)
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGINT, replayer.interrupt)
            handler = True
        except (NotImplementedError, RuntimeError, ValueError):
            handler = False
        bar = ticker = None
        if getattr(args, "progress", True):
            from tqdm import tqdm

            bar = tqdm(total=args.duration, unit="s", file=sys.stderr, desc="agentx",
                       bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s {postfix}")
            ticker = asyncio.ensure_future(_ticker(replayer, bar, args.duration))
        started = time.time()
        try:
            records = await replayer.run()
        finally:
            if handler:
                loop.remove_signal_handler(signal.SIGINT)
            if ticker is not None:
                ticker.cancel()
                bar.close()
        hits_after = await scrape_hit_tokens_by_source(transport, metrics_urls) \
            if hits_before is not None else None
    finally:
        if own:
            await transport.aclose()
    prices = {"cached_input": args.price_cached_input, "uncached_input": args.price_input,
              "output": args.price_output}
    metrics = compute_metrics(records, devices=args.devices,
                              device_price_per_hour=args.device_price_per_hour, prices=prices,
                              hit_tokens_by_source=counter_delta(hits_before, hits_after))
    result = {
        "command": "agentx",
        "started_at": started,
        "interrupted": replayer.interrupted,
        "config": {
            "endpoint": args.endpoint, "model": info.model, "traces": list(args.traces),
            "num_traces": len(sessions), "concurrency": args.concurrency,
            "duration_s": args.duration, "time_scale": args.time_scale,
            "trace_block_size": block_size, "scale": block_tokens,
            "scale_factor": block_tokens / block_size, "scale_output": args.scale_output,
            "max_context": max_context, "max_output": max_output, "warmup": args.warmup,
            "seed": args.seed, "pull_in_s": args.pull_in, "devices": args.devices,
            "temperature": getattr(args, "temperature", None),
            "metrics_urls": metrics_urls,
            "marker_tokens": builder.marker_tokens,
            "truncation": "leading tokens kept (prefix structure), context minus max_tokens",
        },
        "server": {"mode": info.mode, "vocab_size": info.vocab_size,
                   "vocab_source": info.vocab_source, "max_model_len": info.max_model_len,
                   "ids_prompt_tokens_delta": info.ids_prompt_tokens_delta,
                   "text_token_ratio": info.text_token_ratio, "text_stable": info.text_stable,
                   "notes": info.notes},
        "replay": {"session_replays": replayer._replays, "pulled_in_s": replayer.pacer.pulled_in_s},
        "metrics": metrics,
    }
    if getattr(args, "records", False):
        result["records"] = [r.to_dict() for r in records]
    return result


def main(args) -> int:
    from loomserve.bench import report
    from loomserve.bench.trace import load_traces

    sessions = load_traces(args.traces)
    if not sessions:
        print("no traces found", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run_replay(args, sessions))
    except RuntimeError as e:
        print(f"agentx: {e}", file=sys.stderr)
        return 1
    print(report.summary_table(result), file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    if args.plots:
        for path in report.write_run_plots(result, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0 if result["metrics"]["requests"]["ok"] > 0 else 1
