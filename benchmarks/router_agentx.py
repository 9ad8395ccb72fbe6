"""Router under AgentX-style traffic: 3 instances behind `loomserve router`, one policy at a
time, at two KV capacities, beside one instance with 3x the pool (the ideal); and a fault run
(an instance SIGKILLed mid-replay).

Each run: fresh instances (SmolLM2-135M, float32, KV events on), the router with the policy, a
`loomserve bench agentx` replay of the same traces at the same concurrency and seed (greedy,
`--temperature 0`), then the table row: served hit rate, TPGS, TTFT p50/p90, E2E
interactivity, errors. Traces: the weka traces coarsened to the model's context plus synthetic
AgentX-shaped sessions with forked subagents (benchmarks/common/agent_cluster.py explains the
coarsening); written once under benchmarks/results/traces_issue11/.

Capacities (per instance, printed with the arithmetic): `half` holds the peak KV of half the
live sessions, `tenth` of a tenth (concurrency x fraction x the mean per-session peak), never
less than one full context. The ideal is one instance with 3x that pool.

Targets (issue 11): default policy's served hit rate within 3 points of the ideal, and >= 20
points above round robin at the tight capacity (`tenth`); TPGS >= 1.3x round robin there.

Resumable: finished runs are kept in benchmarks/results/router_agentx.json (key
capacity/policy); a rerun skips them unless --force.

    python benchmarks/router_agentx.py                       # headline runs, then the rest
    python benchmarks/router_agentx.py --runs tenth/round_robin tenth/default tenth/ideal
    python benchmarks/router_agentx.py --runs fault/half --kill-at 60
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, host_info  # noqa: E402
from common.agent_cluster import (  # noqa: E402
    Instance,
    ResultStore,
    instance_counters,
    kv_bytes_per_token,
    prepare_traces,
    replay,
    router_counters,
    serve_argv,
    session_working_set,
    start_instances,
    start_router,
    stop_all,
    summarize,
)

FRACTIONS = {"half": 0.5, "tenth": 0.1}
POLICIES = ["round_robin", "default", "ideal", "least_loaded", "session", "kv_aware"]
DEFAULT_RUNS = ([f"tenth/{p}" for p in POLICIES[:3]] + [f"half/{p}" for p in POLICIES[:3]]
                + [f"tenth/{p}" for p in POLICIES[3:]] + [f"half/{p}" for p in POLICIES[3:]])
TRACES_DIR = os.path.join(RESULTS_DIR, "traces_issue11")


def pool_plan(a, ws: dict) -> dict:
    """Per-instance pool tokens and MiB for each capacity, with the arithmetic as text."""
    plan = {}
    floor_tokens = a.max_context + 64  # one full-context request must fit
    per_token = kv_bytes_per_token(a.model)
    for name, frac in FRACTIONS.items():
        want = a.concurrency * frac * ws["mean_tokens"]
        tokens = max(math.ceil(want), floor_tokens)
        nbytes = tokens * per_token
        mib = round(nbytes / 2**20, 2)
        plan[name] = {"tokens": tokens, "bytes": nbytes, "mib": mib,
                      "sessions_held": round(tokens / ws["mean_tokens"], 2),
                      "text": (f"{name}: {a.concurrency} sessions x {frac} x "
                               f"{ws['mean_tokens']} tokens = {want:.0f} tokens"
                               + (f" -> floor {floor_tokens} (one full context)"
                                  if tokens > want else "")
                               + f" x {per_token} B/token = {mib} MiB per instance "
                               f"({tokens / ws['mean_tokens']:.2f} sessions); ideal 3x")}
    return plan


def ports(slot: int) -> tuple[int, list[int]]:
    """Router port and instance ports of a run slot (rotated so a port still in TIME_WAIT
    from the previous run is never reused at once). Events take port+1 and +2."""
    base = 24100 + (slot % 8) * 50
    return base, [base + 10, base + 20, base + 30]


def pin_args(a, pool_bytes: int) -> list[str]:
    """Session pinning flags: --pin-ttl seconds, a budget of --pin-share of each pool."""
    if a.pin_ttl <= 0:
        return []
    return ["--session-pin-ttl", str(a.pin_ttl),
            "--session-pin-budget", str(int(a.pin_share * pool_bytes))]


def instances_for(policy: str, nbytes: int, a, slot: int) -> list[Instance]:
    _, ps = ports(slot)
    model = [a.model] if a.model else []
    if policy == "ideal":  # one instance, 3x the pool, the machine's two cores
        return [Instance("ideal", ps[0], ps[0] + 1,
                         serve_argv(ps[0], 3 * nbytes, a.max_context, a.dtype, ps[0] + 1,
                                    model + pin_args(a, 3 * nbytes)),
                         threads=a.ideal_threads)]
    return [Instance(f"inst{i}", p, p + 1,
                     serve_argv(p, nbytes, a.max_context, a.dtype, p + 1,
                                model + pin_args(a, nbytes)),
                     threads=a.instance_threads)
            for i, p in enumerate(ps)]


def killer(victim: Instance, kill_at: float, log: dict):
    """The fault: SIGKILL victim `kill_at` s after the replay started (unless it ended)."""
    def during(proc, t0):
        while time.monotonic() - t0 < kill_at:
            if proc.poll() is not None:
                return
            time.sleep(0.2)
        victim.kill()
        log["killed_at_s"] = round(time.monotonic() - t0, 1)
        log["victim"] = victim.url
        print(f"  SIGKILLed {victim.name} at {log['killed_at_s']} s", file=sys.stderr,
              flush=True)
    return during


def check_outputs(result: dict, url: str, n: int = 8) -> dict:
    """Re-send the last n completed requests of the replay (greedy, same prompt ids and
    max_tokens) to one surviving instance directly: the text must equal what the replay got
    through the router (the answer does not depend on where the session landed)."""
    import httpx
    recs = [r for r in result.get("records") or [] if not r.get("primer") and not r.get("error")
            and r.get("prompt_ids") and r.get("output_text") is not None]
    recs = sorted(recs, key=lambda r: r["send_time"])[-n:]
    same = 0
    with httpx.Client(timeout=300) as c:
        for r in recs:
            body = {"prompt": r["prompt_ids"], "max_tokens": r["max_tokens"], "temperature": 0,
                    "ignore_eos": True}
            text = c.post(url + "/v1/completions", json=body).json()["choices"][0]["text"]
            same += text == r["output_text"]
    return {"checked": len(recs), "identical": same}


def run_one(key: str, a, traces: list[str], plan: dict, slot: int) -> dict:
    kind, rest = key.split("/", 1)
    fault = kind == "fault"
    cap, policy = (rest, "default") if fault else (kind, rest)
    mib = plan[cap]["mib"]
    insts = instances_for(policy, plan[cap]["bytes"], a, slot)
    router = None
    t0 = time.monotonic()
    try:
        start_instances(insts)
        if policy == "ideal":
            endpoint = insts[0].url
        else:
            router_port, _ = ports(slot)
            router = start_router([i.url for i in insts], router_port, policy,
                                  a.router_args.split())
            endpoint = router.url
        log: dict = {}
        during = killer(insts[1], a.kill_at, log) if fault else None
        out = os.path.join("/tmp", f"router_agentx-{key.replace('/', '-')}.json")
        res = replay(endpoint, traces, a, [i.url for i in insts], out, during=during)
        row = summarize(res)
        if router is not None and hasattr(router, "server"):
            row["router_counters"] = router_counters(router.url)
        row["instance_counters"] = {i.name: instance_counters(i.url) for i in insts}
        if fault:
            row["fault"] = {**log, "replay_finished": True,
                            "output_check": check_outputs(res, insts[0].url)}
        row.update({"kv_cache_mib_per_instance": round(mib * (3 if policy == "ideal" else 1), 2),
                    "instances": len(insts), "wall_s": round(time.monotonic() - t0, 1),
                    "loadavg_1m_end": round(os.getloadavg()[0], 2),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
        return row
    finally:
        if router is not None:
            router.stop()
        stop_all(insts)


def table(runs: dict) -> str:
    rows = []
    for key in sorted(runs):
        r = runs[key]
        rows.append([key, r["kv_cache_mib_per_instance"], f"{r['hit_served']:.3f}",
                     f"{r['hit_theoretical']:.3f}", f"{r['tpgs']:.0f}",
                     f"{r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f}",
                     f"{r['interactivity_e2e']:.2f}", r["requests_ok"], r["errors"]])
    heads = ["run", "KV MiB/inst", "hit served", "hit theor.", "TPGS", "TTFT p50/p90 s",
             "interact. E2E tok/s", "ok", "err"]
    return "\n".join("| " + " | ".join(str(c) for c in r) + " |"
                     for r in [heads, ["---"] * len(heads), *rows])


def verdicts(runs: dict) -> list[str]:
    out = []
    for cap in FRACTIONS:
        d, rr, ideal = (runs.get(f"{cap}/{p}") for p in ("default", "round_robin", "ideal"))
        if d and ideal:
            gap = (ideal["hit_served"] - d["hit_served"]) * 100
            out.append(f"{cap}: default vs ideal hit: {gap:+.1f} points below the ideal "
                       f"(target <= 3): {'met' if gap <= 3 else 'NOT met'}")
        if d and rr:
            gain = (d["hit_served"] - rr["hit_served"]) * 100
            ratio = d["tpgs"] / rr["tpgs"] if rr["tpgs"] else float("nan")
            out.append(f"{cap}: default vs round robin: hit +{gain:.1f} points (target >= 20 "
                       f"at tenth), TPGS {ratio:.2f}x (target >= 1.3 at tenth)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", default=DEFAULT_RUNS,
                    help="capacity/policy keys in order (policy 'ideal' = one 3x instance), "
                         "or fault/<capacity> (default policy, needs --kill-at)")
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--time-scale", type=float, default=0.25)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--scale", type=int, default=32, help="tokens per (coarse) trace block")
    ap.add_argument("--weka-k", type=int, default=80,
                    help="64-token weka blocks per coarse block (default: %(default)s)")
    ap.add_argument("--synth-sessions", type=int, default=24)
    ap.add_argument("--forked", type=float, default=0.5, help="forked share of subagents")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default=None,
                    help="model folder (default: the built-in SmolLM2-135M)")
    ap.add_argument("--drain-timeout", type=float, default=45.0)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--kill-at", type=float, default=60.0,
                    help="fault runs: SIGKILL instance 1 this many s into the replay")
    ap.add_argument("--once", action="store_true",
                    help="fixed work: each live session replays one trace to its end (bench "
                         "agentx --once; --duration caps it), so every run, the ideal included, "
                         "serves the same requests")
    ap.add_argument("--ideal-threads", type=int, default=2,
                    help="torch threads of the ideal instance (default: the 2 cores it has alone)")
    ap.add_argument("--instance-threads", type=int, default=1,
                    help="torch threads of each of the three instances (default 1: three share "
                         "two cores)")
    ap.add_argument("--pin-ttl", type=float, default=0.0,
                    help="instances pin each session's prefix through pauses this long (s; 0: off)")
    ap.add_argument("--pin-share", type=float, default=0.5,
                    help="pin budget as a share of each instance's pool")
    ap.add_argument("--router-args", default="",
                    help="extra `loomserve router` flags in one string, e.g. "
                         "\"--overload-factor 2\"")
    ap.add_argument("--force", action="store_true", help="redo runs already in the results")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "router_agentx.json"))
    a = ap.parse_args()

    traces = prepare_traces(TRACES_DIR, a.weka_k, a.synth_sessions, a.forked, a.seed)
    ws = session_working_set(traces, a.scale, a.max_context, a.max_output)
    plan = pool_plan(a, ws)
    print(f"per-session working set: mean {ws['mean_tokens']} tokens over {ws['traces']} traces"
          f" (min {ws['min_tokens']}, max {ws['max_tokens']})", file=sys.stderr)
    for p in plan.values():
        print("  " + p["text"], file=sys.stderr)
    store = ResultStore(a.out, {"host": host_info(), "args": vars(a), "working_set": ws,
                                "pools": plan, "traces": [os.path.relpath(t, RESULTS_DIR)
                                                          for t in traces]})
    for slot, key in enumerate(a.runs):
        if store.done(key) and not a.force:
            print(f"{key}: done (kept)", file=sys.stderr)
            continue
        print(f"{key}: starting", file=sys.stderr, flush=True)
        try:
            store.put(key, run_one(key, a, traces, plan, slot))
        except Exception as e:  # keep going: the other runs still count
            print(f"{key}: FAILED: {e}", file=sys.stderr, flush=True)
            store.data.setdefault("failed", {})[key] = str(e)[-2000:]
            store.save()
            continue
        store.data.get("failed", {}).pop(key, None)
        store.save()
        print(table({key: store.data["runs"][key]}), file=sys.stderr, flush=True)
    runs = store.data["runs"]
    text = table({k: v for k, v in runs.items() if not k.startswith("fault")})
    lines = verdicts(runs)
    md = os.path.splitext(a.out)[0] + ".md"
    with open(md, "w") as f:
        f.write("\n".join(p["text"] for p in plan.values()) + "\n\n" + text + "\n\n"
                + "\n".join(lines) + "\n")
    print(text + "\n" + "\n".join(lines), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
