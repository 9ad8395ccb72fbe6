"""The replay's session driver: N live session trees replayed closed-loop (`Replayer`).

- Concurrency N = N live session trees. Each slot replays one trace (main agent + subagent
  groups); when it ends the slot starts the next trace (cycling) from turn 0 with a fresh
  session marker, so no two replays share cache.
- Warm start: each slot starts at a random turn k>=1 of its first trace and first sends a
  one-token primer of turn k-1 (same prompt); primers are recorded but excluded from metrics.
  `--duration` counts from the moment every slot's primer is back.
- `once` (fixed work): each slot replays only its first trace and stops; the run ends when
  every slot has, so two servers replayed with the same seed get the same requests.
- Requests: streaming, include_usage, ignore_eos, max_tokens = recorded out (capped);
  temperature only when asked. Prompts come from prompts.py (token ids or stable text).

Invariants (timing, all scaled by time_scale):
- an agent's next request goes out max(0, t_k - t_(k-1) - api_time_(k-1)) after the LIVE end
  of its previous request (think_time when api_time is missing);
- a subagent's first request is timed from its parent turn's end the same way; a parent turn
  after a joined group also waits for the group and for the recorded gap after the group's end;
- every request sent is recorded exactly once (errors and cancellations included).
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass, field

from loomserve.bench.metrics import RequestRecord
from loomserve.bench.prompts import PrefixTracker, PromptBuilder, ids_to_text
from loomserve.bench.replay.timing import Clock, Pacer
from loomserve.bench.replay.transport import Transport, TransportError

__all__ = ["Replayer"]


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
                 keep_outputs: bool = False, temperature: float | None = None,
                 once: bool = False) -> None:
        self.once = once  # fixed work: one trace per slot, then the slot ends
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
            if self.once:
                return
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
                    rec.miss_causes = details.get("miss_causes")
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
