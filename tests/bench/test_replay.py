"""Replay timing rules on a fake clock against an in-process fake server (no real sleeping)."""

from __future__ import annotations

import asyncio
import heapq

import pytest

from loomserve.bench.metrics import compute_metrics
from loomserve.bench.prompts import PromptBuilder
from loomserve.bench.replay import Pacer, Replayer
from loomserve.bench.trace import Session, Subagent, SubagentGroup, TraceRequest


class FakeClock:
    """Virtual time: sleep() parks on a timer; run() advances to the next timer whenever every
    other task is blocked."""

    def __init__(self) -> None:
        self.t = 0.0
        self._timers: list = []
        self._seq = 0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._timers, (self.t + seconds, self._seq, fut))
        await fut

    async def _settle(self) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(3):
            await asyncio.sleep(0)
            while loop._ready:  # noqa: SLF001 - CPython: nothing else runnable once empty
                await asyncio.sleep(0)

    async def run(self, coro, max_steps: int = 100_000):
        task = asyncio.ensure_future(coro)
        for _ in range(max_steps):
            await self._settle()
            if task.done():
                return task.result()
            while self._timers and self._timers[0][2].done():
                heapq.heappop(self._timers)
            if not self._timers:
                raise RuntimeError("deadlock: every task waits and no timer is set")
            self.t = max(self.t, self._timers[0][0])
            while self._timers and self._timers[0][0] <= self.t:
                fut = heapq.heappop(self._timers)[2]
                if not fut.done():
                    fut.set_result(None)
        raise RuntimeError("too many steps")


class FakeServer:
    """Records sends; answers with `max_tokens` one-token chunks. Latency: ttft + (n-1) * itl,
    where ttft may depend on the request (a function of body and headers)."""

    def __init__(self, clock: FakeClock, ttft=1.0, itl=0.0) -> None:
        self.clock = clock
        self.ttft = ttft
        self.itl = itl
        self.sends: list[dict] = []

    async def stream(self, body: dict, headers: dict):
        self.sends.append({"t": self.clock.now(), "body": body, "headers": dict(headers)})
        ttft = self.ttft(body, headers) if callable(self.ttft) else self.ttft
        await self.clock.sleep(ttft)
        n = body["max_tokens"]
        for i in range(n):
            if i:
                await self.clock.sleep(self.itl)
            yield {"choices": [{"index": 0, "text": "x",
                                "finish_reason": "length" if i == n - 1 else None}]}
        yield {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                        "completion_tokens": n,
                                        "prompt_tokens_details": {"cached_tokens": 0}}}

    async def request_json(self, method, path, body=None):
        return 404, None

    async def aclose(self):
        pass


def req(t, api=None, out=1, ids=(1, 2), in_tokens=None, agent="main", think=0.0):
    ids = tuple(ids)
    return TraceRequest(t=t, in_tokens=in_tokens or 64 * len(ids), out_tokens=out, hash_ids=ids,
                        think_time=think, api_time=api, agent=agent)


def session(sid, main, groups=()):
    return Session(id=sid, path=f"{sid}.json", block_size=64, models=["m"], main=list(main),
                   groups=list(groups))


def replay(sessions, clock, server, **kw):
    opts = dict(concurrency=1, duration=1000.0, time_scale=1.0, warmup=False, seed=0,
                pull_in_s=10.0, drain_timeout_s=100.0, max_context=4096, run_nonce="t")
    opts.update(kw)
    r = Replayer(sessions, transport=server, clock=clock, builder=PromptBuilder(32000, 4),
                 model="m", **opts)
    records = asyncio.run(clock.run(r.run()))
    return r, records


def times(server, pred=lambda s: True):
    return [s["t"] for s in server.sends if pred(s)]


def test_gap_from_live_end_minus_api_time_scaled():
    clock = FakeClock()
    server = FakeServer(clock, ttft=1.0)
    s = session("a", [req(0, api=2), req(10, api=1), req(20, api=30), req(25)])
    # r0 0..1; r1 at 1 + (10-0-2)*0.5 = 5 (ends 6); r2 at 6 + (20-10-1)*0.5 = 10.5 (ends 11.5);
    # r3: 25-20-30 < 0 -> clamped: sent at the live end 11.5
    replay([s], clock, server, time_scale=0.5, duration=11.6)
    assert times(server) == pytest.approx([0.0, 5.0, 10.5, 11.5])


def test_think_time_when_api_time_missing():
    clock = FakeClock()
    server = FakeServer(clock, ttft=1.0)
    s = session("a", [req(0), req(10, think=3.0)])
    replay([s], clock, server, duration=4.5)
    assert times(server)[:2] == pytest.approx([0.0, 4.0])


def test_idle_pull_in_within_10s():
    clock = FakeClock()
    server = FakeServer(clock, ttft=1.0)
    s = session("a", [req(0, api=1), req(500, api=1)])
    r, _ = replay([s], clock, server, duration=12)
    # the 499 s gap starts at the live end (1); nothing in flight -> sent by 1 + 10
    assert times(server)[:2] == pytest.approx([0.0, 11.0])
    assert r.pacer.pulled_in_s == pytest.approx(489.0)


def test_pacer_no_pull_in_while_in_flight():
    clock = FakeClock()

    async def scenario():
        pacer = Pacer(clock, pull_in_s=10.0)
        runner = asyncio.ensure_future(pacer.run())
        pacer.begin()
        released = []

        async def waiter(deadline):
            await pacer.wait_until(deadline)
            released.append((deadline, clock.now()))
            pacer.begin()  # a 1 s request
            await clock.sleep(1.0)
            pacer.end()

        w = [asyncio.ensure_future(waiter(d)) for d in (101.0, 131.0)]
        await clock.sleep(50.0)   # in flight until 50: nothing pulled in yet
        assert not released
        pacer.end()               # idle from 50 -> first timer by 60 (both shifted by 41)
        await asyncio.gather(*w)
        pacer.close()
        runner.cancel()
        return released

    released = asyncio.run(clock.run(scenario()))
    # the first request runs 60..61; idle again -> the second (now at 90) goes by 71
    assert [r[1] for r in released] == pytest.approx([60.0, 71.0])


def _sub_session(joined: bool):
    sub = Subagent(agent_id="sub1", subagent_type="Explore", t=2.0, duration_ms=4000.0,
                   requests=[req(2, api=1, ids=(9,), agent="sub1"),
                             req(5, api=1, ids=(9, 10), agent="sub1")])
    return session("a", [req(0, api=1), req(30, api=1), req(31)],
                   [SubagentGroup(subagents=[sub], after_index=0, joined=joined)])


def _slow_subagents(body, headers):
    return 20.0 if "X-Parent-Session-ID" in headers else 1.0


@pytest.mark.parametrize("joined", [False, True])
def test_subagent_group_after_parent_turn_joined_vs_background(joined):
    clock = FakeClock()
    server = FakeServer(clock, ttft=_slow_subagents)
    replay([_sub_session(joined)], clock, server, pull_in_s=1e6, duration=80)
    is_sub = lambda s: "X-Parent-Session-ID" in s["headers"]  # noqa: E731
    main_t = times(server, lambda s: not is_sub(s))
    sub_t = times(server, is_sub)
    # parent turn 0: 0..1; subagent request 0 at 1 + (2 - (0+1)) = 2 (ends 22), request 1 at
    # 22 + (5-2-1) = 24 (ends 44); recorded group end 5 + 1 = 6
    assert sub_t[:2] == pytest.approx([2.0, 24.0])
    if joined:  # waits for the group, then the recorded gap after it: 44 + (30 - 6) = 68
        assert main_t[:2] == pytest.approx([0.0, 68.0])
    else:       # background: 1 + (30 - 0 - 1) = 30, while the subagent still runs
        assert main_t[:2] == pytest.approx([0.0, 30.0])
    main_sid = server.sends[0]["headers"]["X-Session-ID"]
    for s in server.sends[:4]:
        h = s["headers"]
        if is_sub(s):
            assert h["X-Parent-Session-ID"] == main_sid
            assert h["X-Session-ID"] == f"{main_sid}/sub1"
        else:
            assert h["X-Session-ID"] == main_sid


def test_session_ends_after_background_subagents():
    clock = FakeClock()
    server = FakeServer(clock, ttft=_slow_subagents)
    a = _sub_session(False)
    b = session("b", [req(0)])
    replay([a, b], clock, server, pull_in_s=1e6, duration=80)
    # a's last main turn ends at 32, its subagent at 44: b starts only then
    b_sends = [s for s in server.sends if s["headers"]["X-Session-ID"].endswith("-2")]
    assert b_sends and b_sends[0]["t"] == pytest.approx(44.0)


def test_closed_loop_refills_slot_with_next_trace_fresh_marker():
    clock = FakeClock()
    server = FakeServer(clock, ttft=1.0)
    a = session("a", [req(0, ids=(1, 2, 3))])
    b = session("b", [req(0, ids=(1, 2, 3))])
    r, records = replay([a, b], clock, server, duration=2.5)
    assert [rec.trace for rec in records] == ["a", "b", "a"]
    assert times(server) == pytest.approx([0.0, 1.0, 2.0])
    sids = [s["headers"]["X-Session-ID"] for s in server.sends]
    assert len(set(sids)) == 3
    p0, p2 = server.sends[0]["body"]["prompt"], server.sends[2]["body"]["prompt"]
    m = r.builder.marker_tokens
    assert p0[:m] != p2[:m] and p0[m:] == p2[m:]  # same trace: same blocks, fresh marker
    # two different traces with the same local ids get different blocks (id scope = trace)
    assert server.sends[1]["body"]["prompt"][m:] != p0[m:]


def test_concurrency_slots_and_cycling():
    clock = FakeClock()
    server = FakeServer(clock, ttft=1.0)
    traces = [session(x, [req(0)]) for x in "abc"]
    _, records = replay(traces, clock, server, concurrency=2, duration=1.5)
    # slots start on a and b; the next trace for whichever slot frees first is c, then a
    assert sorted(rec.trace for rec in records[:2]) == ["a", "b"]
    assert sorted(rec.trace for rec in records[2:4]) == ["a", "c"]


def test_warm_start_primer_sent_and_excluded():
    clock = FakeClock()
    server = FakeServer(clock, ttft=1.0)
    main = [req(10 * i, api=1, out=5, ids=range(1, i + 2)) for i in range(6)]
    r, records = replay([session("a", main)], clock, server, warmup=True, seed=3, duration=12)
    first = records[0]
    assert first.primer and first.max_tokens == 1 and server.sends[0]["body"]["max_tokens"] == 1
    k = first.turn + 1
    assert records[1].turn == k and not records[1].primer and records[1].max_tokens == 5
    # the primer carries the prompt of turn k-1, a prefix of turn k's prompt
    p0, p1 = server.sends[0]["body"]["prompt"], server.sends[1]["body"]["prompt"]
    assert p1[:len(p0)] == p0 and len(p1) > len(p0)
    # records[1] is timed from the primer's live end: 1 + (10 - 1) = 10
    assert server.sends[1]["t"] == pytest.approx(10.0)
    m = compute_metrics(records)
    assert m["requests"]["primers"] == 1
    assert m["requests"]["ok"] == len(records) - 1
    assert records[1].theoretical_cached_tokens == len(p0)  # the primer warmed it


def test_request_body_and_output_cap():
    clock = FakeClock()
    server = FakeServer(clock, ttft=1.0)
    _, records = replay([session("a", [req(0, out=500, ids=range(100))])], clock, server,
                        duration=0.5, max_context=256, max_output=64)
    body = server.sends[0]["body"]
    assert body["stream"] and body["ignore_eos"] and body["stream_options"]["include_usage"]
    assert body["max_tokens"] == 64
    assert len(body["prompt"]) == 256 - 64 and records[0].truncated
    assert all(1000 <= t < 32000 for t in body["prompt"])
    assert records[0].output_tokens == 64 and records[0].prompt_tokens == 192


def test_errors_recorded_by_kind():
    from loomserve.bench.replay import TransportError

    clock = FakeClock()

    class Failing(FakeServer):
        async def stream(self, body, headers):
            self.sends.append({"t": self.clock.now(), "body": body, "headers": headers})
            await self.clock.sleep(0.5)
            raise TransportError("http_503", "busy")
            yield  # pragma: no cover

    server = Failing(clock)
    _, records = replay([session("a", [req(0), req(1)])], clock, server, duration=1.0)
    assert records and all(r.error == "http_503" for r in records)
    assert compute_metrics(records)["errors_by_kind"] == {"http_503": len(records)}


def test_duration_counts_from_the_end_of_the_primers():
    clock = FakeClock()
    server = FakeServer(clock, ttft=lambda body, headers: 5.0 if body["max_tokens"] == 1 else 1.0)
    main = [req(10 * i, api=1, out=1, ids=range(1, i + 2)) for i in range(6)]
    _, records = replay([session("a", main)], clock, server, warmup=True, seed=3, duration=12)
    assert records[0].primer
    # primer back at 5; the next turn goes at 5 + (10 - 1) = 14, inside the 12 s measured window
    # that opens at 5 (a timer started before the primer would have closed at 12)
    measured = [s["t"] for s in server.sends[1:]]
    assert measured and measured[0] == pytest.approx(14.0)


def test_records_keep_the_sent_prompts_when_asked():
    clock = FakeClock()
    server = FakeServer(clock, ttft=1.0)
    main = [req(10 * i, api=1, out=1, ids=range(1, i + 2)) for i in range(3)]
    _, records = replay([session("a", main)], clock, server, keep_prompts=True)
    assert [r.prompt_ids for r in records] == [s["body"]["prompt"] for s in server.sends]
    clock2 = FakeClock()
    _, plain = replay([session("a", main)], clock2, FakeServer(clock2))
    assert all(r.prompt_ids is None for r in plain)


def test_once_replays_each_slots_first_trace_then_ends():
    """Fixed work: with `once` the slot does not cycle on to the next trace, and the run ends
    when its trace does, long before --duration; without it the slot cycles."""
    a = session("a", [req(0), req(5)])
    b = session("b", [req(0), req(5), req(9)])
    clock = FakeClock()
    server = FakeServer(clock, ttft=1.0)
    r, records = replay([a, b], clock, server, once=True)
    assert len(server.sends) == 2 and len(records) == 2
    assert clock.now() < 100.0
    cycling = FakeServer(FakeClock(), ttft=1.0)
    replay([a, b], cycling.clock, cycling, duration=30.0)
    assert len(cycling.sends) > 2
