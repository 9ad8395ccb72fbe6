"""Prefill/decode disaggregation under agent traffic: 1 prefill + 1 decode instance (router with
PD on) against 2 co-located instances (router, default policy), on warm agent turns plus cold
~6K-token prefills (fresh subagents).

Traffic (a driver in this script, /v1/completions with token-id prompts, streaming):
  warm    W sessions, each a fixed context (--warm-context tokens) primed once, then turns that
          add a short new suffix (--warm-suffix tokens) and stream --warm-output tokens
          (ignore_eos), one after another with a short think gap; every --warm-cycle turns
          the session compacts back to its primed context. Their turns are almost all
          cached: the router sends them straight to decode.
  cold    from the second phase on, a fresh subagent of a warm session (X-Parent-Session-ID)
          every --cold-every s: --cold-tokens unique tokens, 16 output tokens. Above
          --pd-threshold-tokens uncached, the router sends them through the prefill instance.
Phases per layout: `quiet` (warm only, --quiet s) then `cold` (warm + cold arrivals for
--loaded s, the phase lasting until the last cold request has finished, so that the decode
legs' KV imports fall inside it). Reported: the warm sessions' inter-token latency p50/p99
(gaps between streamed chunks after the first), and p99.9 and max, which see a handover's
stall, per phase and layout; the cold requests' TTFT; errors. With --repeats N every layout runs
N times, interleaved, for the spread across runs. Target: PD's warm ITL p99 with cold prefills
within 1.5x of its ITL without them; the co-located figure is reported beside it.

Correctness: --check-prompts prompts of --check-tokens tokens sent greedily through the PD
router (so they take the prefill -> decode path) must produce the same text as a co-located
instance of the same model answering them alone.

    python benchmarks/pd_agentx.py [--quiet 90 --loaded 90] [--layouts pd colo]

Writes benchmarks/results/pd_agentx.json. Ports 24500-24599.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, host_info  # noqa: E402
from common.agent_cluster import (  # noqa: E402
    Instance,
    ResultStore,
    router_counters,
    serve_argv,
    start_instances,
    start_router,
    stop_all,
)

from loomserve.bench.replay.transport import sse_lines  # noqa: E402

VOCAB_LO = 100  # past the special tokens
VOCAB_HI = [40000]  # below the vocabulary size (--vocab-hi; SmolLM2 has 49K)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LO, VOCAB_HI[0]) for _ in range(n)]


async def stream(client, url: str, prompt: list[int], max_tokens: int, headers: dict) -> dict:
    """One streaming completion: chunk arrival times, text, error (never raises)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True}
    t0 = time.monotonic()
    times: list[float] = []
    text: list[str] = []
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers=headers) as resp:
            if resp.status_code != 200:
                return {"error": f"http_{resp.status_code}", "t0": t0}
            async for line in sse_lines(resp.aiter_text()):  # CR/LF only, as SSE
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if payload.get("error"):
                    return {"error": "stream_error", "t0": t0}
                ch = payload.get("choices") or []
                if ch and ch[0].get("text"):
                    times.append(time.monotonic())
                    text.append(ch[0]["text"])
    except Exception as e:  # a transport failure is a counted error, not a crash
        return {"error": type(e).__name__, "t0": t0}
    return {"t0": t0, "times": times, "text": "".join(text), "error": None}


class Phase:
    """The warm records and cold records of one phase; the phase's wall-clock window."""

    def __init__(self, name: str) -> None:
        self.name, self.warm, self.cold = name, [], []
        self.start = self.end = 0.0

    def summary(self) -> dict:
        gaps = [b - a for r in self.warm if not r["error"]
                for a, b in zip(r["times"], r["times"][1:])]
        cold_ttft = [r["times"][0] - r["t0"] for r in self.cold if not r["error"] and r["times"]]
        return {"warm_requests": len(self.warm), "itl_samples": len(gaps),
                "warm_itl_p50_ms": _ms(pct(gaps, 0.5)), "warm_itl_p99_ms": _ms(pct(gaps, 0.99)),
                "warm_itl_p999_ms": _ms(pct(gaps, 0.999)),
                "warm_itl_max_ms": _ms(max(gaps) if gaps else None),
                "cold_requests": len(self.cold), "cold_ttft_p50_s": _r(pct(cold_ttft, 0.5)),
                "errors": sum(1 for r in self.warm + self.cold if r["error"]),
                "window_s": round(self.end - self.start, 1)}


def _ms(x):
    return None if x is None else round(x * 1000, 1)


def _r(x):
    return None if x is None else round(x, 2)


async def warm_session(client, url, a, k: int, stop: asyncio.Event, phases: list,
                       primed: list) -> None:
    rng = random.Random(1000 + k)
    ctx = ids(rng, a.warm_context)
    hdr = {"X-Session-ID": f"warm-{k}"}
    await stream(client, url, ctx, 1, hdr)  # the primer: the context becomes cached
    primed.append(k)
    turn = 0
    while not stop.is_set():
        turn += 1
        # A compaction every --warm-cycle turns (back to the primed, cached context): the
        # contexts, and so the warm steps' cost, have the same spread in every phase, instead
        # of growing through the run and making the later phase slower by itself.
        if turn % a.warm_cycle == 0 or len(ctx) + a.warm_suffix + a.warm_output > \
                a.max_model_len - 64:
            ctx = ctx[:a.warm_context]
        ctx = ctx + ids(rng, a.warm_suffix)
        rec = await stream(client, url, ctx, a.warm_output, hdr)
        phases[-1].warm.append(rec)
        await asyncio.sleep(a.think)


async def cold_arrivals(client, url, a, stop: asyncio.Event, phase: Phase) -> None:
    rng = random.Random(7)
    tasks, n = [], 0
    while not stop.is_set():
        hdr = {"X-Session-ID": f"warm-{n % a.warm}/cold-{n}",
               "X-Parent-Session-ID": f"warm-{n % a.warm}"}

        async def one(prompt=ids(rng, a.cold_tokens), hdr=hdr):
            phase.cold.append(await stream(client, url, prompt, 16, hdr))
        tasks.append(asyncio.create_task(one()))
        n += 1
        try:
            await asyncio.wait_for(stop.wait(), timeout=a.cold_every)
        except asyncio.TimeoutError:
            pass
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=a.request_timeout)


async def drive(url: str, a) -> dict:
    """Quiet phase then cold phase against url; every wait bounded by --request-timeout."""
    import httpx
    stop = asyncio.Event()
    phases = [Phase("quiet")]
    async with httpx.AsyncClient(timeout=a.request_timeout) as client:
        primed: list[int] = []
        warm = [asyncio.create_task(warm_session(client, url, a, k, stop, phases, primed))
                for k in range(a.warm)]
        deadline = time.monotonic() + a.request_timeout
        while len(primed) < a.warm and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # every context cached first
        await asyncio.sleep(a.warmup)  # then steady warm traffic
        phases[0].start = time.monotonic()
        await asyncio.sleep(a.quiet)
        phases[0].end = time.monotonic()
        phases.append(Phase("cold"))
        phases[1].start = time.monotonic()
        cold_stop = asyncio.Event()
        cold = asyncio.create_task(cold_arrivals(client, url, a, cold_stop, phases[1]))
        await asyncio.sleep(a.loaded)
        cold_stop.set()
        # The phase lasts until the last cold request has finished: a decode leg imports its
        # KV and decodes after the prefill, often past --loaded; the warm streams must be
        # measured through that too.
        await asyncio.wait_for(cold, timeout=a.request_timeout)
        phases[1].end = time.monotonic()
        stop.set()
        await asyncio.wait_for(asyncio.gather(*warm), timeout=a.request_timeout)
    return {p.name: p.summary() for p in phases}


async def greedy_texts(url: str, a, usage: list) -> list[str]:
    """Greedy answers to --check-prompts fixed prompts (their usage appended to `usage`)."""
    import httpx
    rng = random.Random(99)
    out = []
    async with httpx.AsyncClient(timeout=a.request_timeout) as client:
        for i in range(a.check_prompts):
            body = {"prompt": ids(rng, a.check_tokens), "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True}
            r = await client.post(url + "/v1/completions", json=body,
                                  headers={"X-Session-ID": f"check-{i}"})
            r.raise_for_status()
            out.append(r.json()["choices"][0]["text"])
            usage.append(r.json().get("usage"))
    return out


def layout(name: str, a) -> tuple[list[Instance], list[str]]:
    base = 24510
    roles = ["prefill", "decode"] if name == "pd" else ["both", "both"]
    insts = []
    for i, role in enumerate(roles):
        p = base + 10 * i
        extra = ["--role", role, "--kv-transfer-host", "127.0.0.1"] + (
            [a.model] if a.model else [])
        argv = serve_argv(p, a.kv_mib * 2**20, a.max_model_len, a.dtype, p + 1, extra)
        if a.pin_cores:  # instance i on core i (its engine core and workers inherit it)
            argv = ["taskset", "-c", str(i % (os.cpu_count() or 1))] + argv
        insts.append(Instance(f"{name}-{role}{i}", p, p + 1, argv))
    router_extra = ["--pd-threshold-tokens", str(a.pd_threshold)] if name == "pd" else []
    return insts, router_extra


def run_layout(name: str, a, store: ResultStore, key: str) -> None:
    insts, router_extra = layout(name, a)
    if a.pin_cores:  # this driver and the router (started below, inheriting it) on the last
        # instance's core: with cold prefills or without, they share the same core
        os.sched_setaffinity(0, {(len(insts) - 1) % (os.cpu_count() or 1)})
    router = None
    try:
        start_instances(insts)
        router = start_router([i.url for i in insts], 24500, "default", router_extra)
        row = asyncio.run(drive(router.url, a))
        before = router_counters(router.url)
        usage: list = []
        # PD: through the router (prefill -> decode); co-located: one instance alone, the
        # reference the PD answers must equal.
        target = router.url if name == "pd" else insts[1].url
        row["greedy_texts"] = asyncio.run(greedy_texts(target, a, usage))
        after = router_counters(router.url)
        row["check_usage"] = usage
        row["check_router_delta"] = {k: v - before.get(k, 0.0) for k, v in after.items()
                                     if v != before.get(k, 0.0)}
        row["router_counters"] = router_counters(router.url)
        row["args"] = {k: v for k, v in vars(a).items() if k not in ("force", "out")}
        row["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        row["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
        store.put(key, row)
    finally:
        if router is not None:
            router.stop()
        stop_all(insts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=["pd", "colo"])
    ap.add_argument("--warm", type=int, default=3, help="warm sessions")
    ap.add_argument("--warm-context", type=int, default=1024)
    ap.add_argument("--warm-suffix", type=int, default=32)
    ap.add_argument("--warm-output", type=int, default=48)
    ap.add_argument("--think", type=float, default=0.5)
    ap.add_argument("--warm-cycle", type=int, default=6,
                    help="turns after which a warm session compacts back to its primed "
                         "context (stationary context lengths across phases)")
    ap.add_argument("--cold-tokens", type=int, default=6144,
                    help="fresh prompt tokens (default: %(default)s; float32 SmolLM2 takes "
                         "46 KB/token, 270 MiB here: the prefill side's --kv-transfer-buffer "
                         "must hold it, else the decode side recomputes)")
    ap.add_argument("--key-suffix", default="", help="store the layouts as NAME+suffix")
    ap.add_argument("--cold-every", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=10.0,
                    help="s after the primers before the quiet phase")
    ap.add_argument("--quiet", type=float, default=90.0,
                    help="s of warm traffic alone (long enough for ~1,500 gaps: the p99 of a "
                         "few hundred is the noise of a handful of steps)")
    ap.add_argument("--loaded", type=float, default=90.0)
    ap.add_argument("--pd-threshold", type=int, default=1024)
    ap.add_argument("--check-prompts", type=int, default=2)
    ap.add_argument("--check-tokens", type=int, default=1536)
    ap.add_argument("--kv-mib", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default=None, help="model folder (default: the built-in one)")
    ap.add_argument("--vocab-hi", type=int, default=40000, help="token ids stay below this")
    ap.add_argument("--request-timeout", type=float, default=400.0)
    ap.add_argument("--pin-cores", action="store_true",
                    help="pin instance i to core i (taskset), this driver and the router to "
                         "the last instance's core: each instance its own core, as on separate "
                         "devices, and nothing migrates to the decode core only when the "
                         "prefill core is busy")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every layout, interleaved (pd, colo, pd, colo, ...): the p99 "
                         "ratio's spread across runs; stored as NAME+suffix#rK")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "pd_agentx.json"))
    a = ap.parse_args()
    VOCAB_HI[0] = a.vocab_hi
    store = ResultStore(a.out, {"host": host_info(), "args": vars(a)})
    for rep in range(a.repeats):
        for name in a.layouts:
            key = name + a.key_suffix + (f"#r{rep}" if a.repeats > 1 else "")
            if store.done(key) and not a.force:
                continue
            print(f"{key}: starting", file=sys.stderr, flush=True)
            try:
                run_layout(name, a, store, key)
            except Exception as e:
                print(f"{key}: FAILED: {e}", file=sys.stderr, flush=True)
                store.data.setdefault("failed", {})[key] = str(e)[-2000:]
                store.save()
    runs = store.data["runs"]
    for name, r in runs.items():
        print(name, json.dumps({k: v for k, v in r.items() if k in ("quiet", "cold")}),
              file=sys.stderr)
    pd_runs = [r for k, r in sorted(runs.items()) if k.startswith("pd")]
    colo_runs = [r for k, r in sorted(runs.items()) if k.startswith("colo")]
    if pd_runs and colo_runs:
        pairs = list(zip(pd_runs, colo_runs))
        same = sum(x == y for p, c in pairs for x, y in zip(p["greedy_texts"], c["greedy_texts"]))
        total = sum(len(p["greedy_texts"]) for p, _ in pairs)
        store.data["greedy_identical"] = f"{same}/{total}"
        store.save()
        print("greedy outputs PD vs single instance identical:", store.data["greedy_identical"],
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
