"""Plumbing for the multi-instance replays (router_agentx.py, pd_agentx.py): the issue-11 trace
set, the pool arithmetic, instances with KV events on, the router (or a round-robin stand-in
while `loomserve router` is not in this checkout), one `bench agentx` replay, and a results file
that keeps finished runs so a crash costs only the run in progress.

Trace set: the real weka traces coarsened to fit a small context, plus `bench synth --profile
cpu --forked-subagents F` sessions (the AgentX shape at short contexts, forked subagents).
Coarsening (`coarsen_trace`): k consecutive 64-token blocks become one block of 64*k tokens
whose id is the k-th id. Ids are chained (an id stands for the whole prefix up to it), so two
requests share j coarse blocks exactly when they shared j*k fine ones: the sharing structure is
kept at a coarser grain. Replayed with `--scale S`, a coarse block is S tokens: a weka prompt
shrinks by 64*k/S and a synthetic one (block 64) by 64/S.

Invariants: only processes this module started are signalled (their own process groups); every
wait has a timeout (server start, replay drain, router start).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from common.paths import REPO_ROOT
from common.results import envelope, write_json
from common.servers import ServerProcess

__all__ = ["env", "coarsen_trace", "prepare_traces", "session_working_set", "KV_BYTES_FP32",
           "Instance", "start_instances", "stop_all", "start_router", "replay", "summarize",
           "ResultStore", "router_available", "router_counters", "kv_bytes_per_token",
           "serve_argv"]

# SmolLM2-135M: 30 layers x 2 (K, V) x 3 KV heads x 64 head dim x 4 bytes (float32).
KV_BYTES_FP32 = 30 * 2 * 3 * 64 * 4
WEKA_DIR = "/work/shared/traces/weka"


def env(threads: int = 1) -> dict:
    """This checkout's loomserve on PYTHONPATH; `threads` torch threads per server (three
    instances share two cores)."""
    return {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "LOOMSERVE_NUM_THREADS": str(threads)}


# -- traces -----------------------------------------------------------------------------------
def _coarsen_requests(reqs: list, k: int) -> list:
    out = []
    for r in reqs:
        r = dict(r)
        if r.get("type") == "subagent":
            r["requests"] = _coarsen_requests(r["requests"], k)
        else:
            r["hash_ids"] = list(r["hash_ids"])[k - 1::k]
        out.append(r)
    return out


def coarsen_trace(doc: dict, k: int) -> dict:
    """The trace with k fine blocks per coarse block (block_size * k); see the module doc."""
    return {**doc, "block_size": doc.get("block_size", 64) * k,
            "requests": _coarsen_requests(doc["requests"], k)}


def prepare_traces(out_dir: str, weka_k: int, synth_sessions: int, forked: float,
                   seed: int) -> list[str]:
    """Write the coarsened weka traces and the synthetic sessions under out_dir (once; reused
    when present). Returns the two directories."""
    weka_out, synth_out = os.path.join(out_dir, f"weka-k{weka_k}"), os.path.join(out_dir, "synth")
    if not glob.glob(os.path.join(weka_out, "*.json")):
        os.makedirs(weka_out, exist_ok=True)
        for path in sorted(glob.glob(os.path.join(WEKA_DIR, "trace_*.json"))):
            with open(path) as f:
                doc = coarsen_trace(json.load(f), weka_k)
            with open(os.path.join(weka_out, os.path.basename(path)), "w") as f:
                json.dump(doc, f, separators=(",", ":"))
    if not glob.glob(os.path.join(synth_out, "*.json")):
        subprocess.run([sys.executable, "-m", "loomserve", "bench", "synth", "--profile", "cpu",
                        "--sessions", str(synth_sessions), "--seed", str(seed),
                        "--forked-subagents", str(forked), "--out", synth_out, "--json"],
                       check=True, stdout=subprocess.DEVNULL, env=env(), timeout=300)
    return [weka_out, synth_out]


def _flat(reqs: list):
    for r in reqs:
        if r.get("type") == "subagent":
            yield from _flat(r["requests"])
        else:
            yield r


def session_working_set(dirs: list[str], scale: int, max_context: int,
                        max_output: int) -> dict:
    """Per trace, the largest prompt it sends as replayed (`in` x scale / block_size, capped at
    max_context - max_output) plus its output: the KV one live session holds at its peak. The
    mean over traces is the per-session working set the pools are sized from (it leaves out a
    fresh subagent's context held beside its parent's: a slight underestimate)."""
    peaks = []
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*.json"))):
            with open(path) as f:
                doc = json.load(f)
            bs = doc.get("block_size", 64)
            peak = max(min(round(r["in"] * scale / bs), max_context - max_output)
                       + min(r["out"], max_output) for r in _flat(doc["requests"]))
            peaks.append(peak)
    return {"traces": len(peaks), "mean_tokens": round(sum(peaks) / len(peaks)),
            "max_tokens": max(peaks), "min_tokens": min(peaks)}


# -- processes --------------------------------------------------------------------------------
@dataclass
class Instance:
    name: str
    port: int
    events_port: int | None
    argv: list[str]
    threads: int = 1
    server: ServerProcess | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Instance":
        self.server = ServerProcess(self.argv, self.port, name=self.name, env=env(self.threads),
                                    startup_timeout=300)
        self.server.start()
        return self

    def kill(self) -> None:
        """SIGKILL the instance's whole process group (server and engine core): a crash."""
        p = self.server.proc if self.server else None
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def kv_bytes_per_token(model: str | None) -> int:
    """K and V bytes of one cached position in float32: the built-in SmolLM2-135M, or from a
    model folder's config.json (layers x 2 x KV heads x head dim x 4)."""
    if model is None:
        return KV_BYTES_FP32
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * kv_heads * head_dim * 4


def serve_argv(port: int, kv_bytes: int, max_model_len: int, dtype: str,
               events_port: int | None, extra: list[str] | None = None) -> list[str]:
    """`loomserve serve` argv; a model folder, when wanted, goes in extra."""
    argv = [sys.executable, "-m", "loomserve", "serve", "--port", str(port), "--dtype", dtype,
            "--kv-cache-memory", str(int(kv_bytes)), "--max-model-len", str(max_model_len)]
    if events_port:
        argv += ["--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}"]
    return argv + list(extra or [])


def start_instances(specs: list[Instance]) -> list[Instance]:
    """Start every instance (one after the other: starts contend for the two cores); on a
    failure stop those already up and re-raise."""
    up: list[Instance] = []
    try:
        for s in specs:
            up.append(s.start())
    except BaseException:
        stop_all(up)
        raise
    return up


def stop_all(items) -> None:
    for it in items:
        with contextlib.suppress(Exception):
            it.stop()


def router_available() -> bool:
    try:
        import importlib.util
        return importlib.util.find_spec("loomserve.control.router.cli") is not None
    except ModuleNotFoundError:
        return False


class _ProxyHandle:
    """The tiers benchmark's round-robin proxy behind the same start/stop as a router."""

    def __init__(self, urls: list[str], port: int) -> None:
        sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
        from tiers_agentx import RoundRobinProxy
        self.proxy = RoundRobinProxy(urls, port)
        self.url = self.proxy.url

    def start(self) -> "_ProxyHandle":
        self.proxy.__enter__()
        return self

    def stop(self) -> None:
        self.proxy.__exit__(None, None, None)


class _RouterHandle:
    def __init__(self, urls: list[str], port: int, policy: str, extra: list[str]) -> None:
        argv = [sys.executable, "-m", "loomserve", "router", "--port", str(port),
                "--host", "127.0.0.1", "--policy", policy]
        for u in urls:
            argv += ["--instance", u]
        self.server = ServerProcess(argv + extra, port, name=f"router-{policy}", env=env(1),
                                    startup_timeout=120)
        self.url = self.server.base_url

    def start(self) -> "_RouterHandle":
        """Healthy, and its tokenizer loaded (until then it routes without prompt knowledge:
        no KV overlap, no PD decision), or 180 s passed (then say so)."""
        self.server.start()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            log = self.server.tail(200_000)
            if "router tokenizer:" in log or "could not load the tokenizer" in log:
                return self
            time.sleep(0.5)
        print("  router tokenizer not loaded after 180 s", file=sys.stderr, flush=True)
        return self

    def stop(self) -> None:
        self.server.stop()


def start_router(urls: list[str], port: int, policy: str, extra: list[str] | None = None):
    """`loomserve router` over urls; without it in this checkout, the round-robin stand-in for
    policy round_robin (a dry run of the harness) and an error for any other policy."""
    if router_available():
        return _RouterHandle(urls, port, policy, list(extra or [])).start()
    if policy == "round_robin":
        print("  loomserve router not in this checkout: round-robin stand-in proxy",
              file=sys.stderr, flush=True)
        return _ProxyHandle(urls, port).start()
    raise RuntimeError(f"policy {policy} needs `loomserve router` (not in this checkout)")


# -- replay -----------------------------------------------------------------------------------
def replay_argv(url: str, traces: list[str], a, metrics_urls: list[str], json_out: str) -> list:
    cmd = [sys.executable, "-m", "loomserve", "bench", "agentx", "--endpoint", url,
           "--traces", *traces, "--concurrency", str(a.concurrency), "--duration",
           str(a.duration), "--time-scale", str(a.time_scale), "--max-context",
           str(a.max_context), "--max-output", str(a.max_output), "--scale", str(a.scale),
           "--seed", str(a.seed), "--temperature", "0", "--drain-timeout",
           str(a.drain_timeout), "--request-timeout", str(a.request_timeout), "--no-progress",
           "--records", "--record-prompts", "--record-outputs", "--json-out", json_out]
    if metrics_urls:
        cmd += ["--metrics-url", *metrics_urls]
    if getattr(a, "once", False):
        cmd.append("--once")
    return cmd


def replay(url: str, traces: list[str], a, metrics_urls: list[str], json_out: str,
           during=None) -> dict:
    """One `bench agentx` run; `during(proc, t0)` (if given) runs in this thread while the
    replay runs (the fault injection). The replay must end within duration + drain + request
    timeout + 300 s (the warm-up primers come before --duration starts): a hang is an error,
    not a wait."""
    cmd = replay_argv(url, traces, a, metrics_urls, json_out)
    print(f"  replay on {url}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env())
    try:
        if during is not None:
            during(proc, t0)
        rc = proc.wait(timeout=a.duration + a.drain_timeout + a.request_timeout + 300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError("bench agentx did not finish: a hang") from None
    if rc != 0:
        raise RuntimeError(f"bench agentx exited with {rc}")
    with open(json_out) as f:
        return json.load(f)


def summarize(result: dict) -> dict:
    m = result["metrics"]
    recs = [r for r in result.get("records") or [] if not r.get("primer")]
    errors: dict[str, int] = {}
    for r in recs:
        if r.get("error"):
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    return {"hit_served": m["hit_rate"]["served"], "hit_theoretical": m["hit_rate"]["theoretical"],
            "tpgs": m["tpgs"], "ttft_p50_s": m["ttft_s"]["p50"], "ttft_p90_s": m["ttft_s"]["p90"],
            "itl_p50_s": m["itl_s"]["p50"], "itl_p99_s": m["itl_s"].get("p99"),
            "interactivity_e2e": m["interactivity"], "window_s": m["window_s"],
            "requests_ok": m["requests"]["ok"], "errors": m["requests"]["errors"],
            "errors_by_kind": errors, "prompt_tokens": m["tokens"]["prompt"],
            "cached_tokens": m["tokens"]["cached"],
            "hit_by_source": m["hit_rate"].get("by_source"), "lost_hits": lost_hits(recs)}


def lost_hits(recs: list[dict]) -> dict:
    """Where served hits fall short of the infinite cache, by request kind: main agent or
    subagent, its first measured request or a later one. lost = (theoretical - served cached
    tokens) over all measured prompt tokens, so the kinds' shares add up to theor. - served."""
    ok = sorted((r for r in recs if not r.get("error") and r.get("cached_tokens") is not None),
                key=lambda r: r["send_time"])
    total = sum(r["intended_prompt_tokens"] for r in ok) or 1
    seen: set = set()
    out: dict[str, dict] = {}
    for r in ok:
        who = (r.get("session"), r.get("agent"))
        kind = ("main" if r.get("agent") == "main" else "subagent") + (
            "/later" if who in seen else "/first")
        seen.add(who)
        k = out.setdefault(kind, {"requests": 0, "prompt": 0, "theoretical": 0, "served": 0})
        k["requests"] += 1
        k["prompt"] += r["intended_prompt_tokens"]
        k["theoretical"] += r["theoretical_cached_tokens"]
        k["served"] += r["cached_tokens"]
    for k in out.values():
        k["lost_share"] = round((k["theoretical"] - k["served"]) / total, 4)
    return out


def router_counters(url: str) -> dict:
    """The router's request/PD/error counters from its /metrics (name{labels} -> value)."""
    return metric_counters(url, "loomserve_router_")


def instance_counters(url: str) -> dict:
    """An instance's preemption and prefix-cache counters from its /metrics."""
    return metric_counters(url, "loomserve_num_preemptions", "loomserve_prefix_cache_")


def metric_counters(url: str, *prefixes: str) -> dict:
    """Counters (`_total` samples) from url's /metrics whose names start with a prefix."""
    import httpx
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out = {}
    for ln in text.splitlines():
        name, _, value = ln.rpartition(" ")
        if ln.startswith(prefixes) and "_total" in name:
            out[name] = float(value)
    return out


class ResultStore:
    """A JSON file of finished runs keyed by name, rewritten after each run (resumable); each
    run carries its own envelope (results.envelope), since one file collects several runs."""

    def __init__(self, path: str, meta: dict) -> None:
        self.path = path
        self.data = {"runs": {}}
        if os.path.exists(path):
            with open(path) as f:
                self.data = json.load(f)
        self.data.update(meta)
        self.data.setdefault("runs", {})

    def done(self, key: str) -> bool:
        return key in self.data["runs"]

    def put(self, key: str, value: dict) -> None:
        self.data["runs"][key] = {"envelope": envelope(), **value}
        self.save()

    def save(self) -> None:
        write_json(self.path, self.data)
