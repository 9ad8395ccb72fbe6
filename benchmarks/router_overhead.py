"""The router's decision cost per request at N sessions (`loomserve router`'s overhead).

What is timed is Router.decide as the HTTP path calls it: the session's prompt rendered with
the model's chat template and tokenized (memoized per session: only the new turn is encoded),
its block hashes (memoized: only new blocks hashed), the KV index walk, and the policy's cost.
No HTTP: the proxy's own cost is the same for every policy.

Setup: --sessions agent conversations sharing a system prompt, each --turns turns deep
(~--history-tokens tokens), spread over --instances instances; the index holds every
session's prefix on its home instance, as the instances' KV events would have it. Then each
session sends its next turn (one more assistant and user message). Paths timed:
  default/turn   the default policy, a known session: sticky, no tokenization at all (every
                 instance's eviction pressure even: none evicts)
  default/pressed  the same on an instance evicting while another does not: the sticky turn
                 is tokenized to see whether its context is gone there (render + memoized
                 encode + new-block hashes + index walk)
  default/fork   a subagent's first request (X-Parent-Session-ID): its parent's instance
  default/cold   a session nobody has seen, unrelated history: render + full encode + hash
  kv_aware/turn  kv_aware on the next turn: render + memoized encode + new-block hashes +
                 index walk + cost
  kv_aware/fork  kv_aware on a subagent's first request: encode seeded from the parent's memo

    python benchmarks/router_overhead.py [--sessions 1000] [--tokenizer tests/fixtures/tiny-agent]
Writes benchmarks/results/router_overhead.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.host import host_info  # noqa: E402
from common.results import write_json  # noqa: E402

from loomserve.control.router.instances import InstanceSet
from loomserve.control.router.kv_index import KVIndex
from loomserve.control.router.metrics import RouterMetrics
from loomserve.control.router.policies import make_policy
from loomserve.control.router.routing import Router
from loomserve.control.router.tokens import PromptKeys
from loomserve.kv.event_wire import MEDIUM_GPU, BlockRemoved, KVEventBatch

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEM = " ".join(f"Rule {i}: keep the build green and explain each change." for i in range(60))




def conversation(s: int, turns: int, filler: int) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Task {s}: fix the failing test in module {s % 97}."}]
    for t in range(turns):
        msgs.append({"role": "assistant", "content": f"Reading file {t} of task {s}."})
        msgs.append({"role": "user", "content": f"file {t} of task {s}: " + " ".join(
            f"line{j}=value{(s * 31 + j) % 1000}" for j in range(filler))})
    return msgs


def make_router(policy: str, tokenizer: str, n_instances: int, block_size: int) -> Router:
    index = KVIndex()
    instances = InstanceSet([f"http://10.0.0.{i}:8000" for i in range(n_instances)], index,
                            events=False)
    for inst in instances.instances:
        inst.up, inst.info = True, {"role": "both", "block_size": block_size}
    router = Router(instances, index, make_policy(policy, index, instances.block_size),
                    RouterMetrics())
    router.keys = PromptKeys.from_folder(tokenizer, block_size)
    return router


def timed(router: Router, body: dict, headers: dict) -> tuple[float, object]:
    t0 = time.perf_counter()
    req = router.request("chat", body, headers)
    d = router.decide(req, body)
    return time.perf_counter() - t0, d


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6


def next_turn(msgs: list[dict], s: int) -> list[dict]:
    return msgs + [{"role": "assistant", "content": "Running the tests."},
                   {"role": "user", "content": f"tests of task {s}: 1 failed"}]


def fork(msgs: list[dict], s: int) -> list[dict]:
    """A subagent's first request: the parent's context, then its own task."""
    return msgs[:1] + [{"role": "user", "content": f"Subtask of {s}: list the test files."}]


def measure(router: Router, requests: list[tuple[list[dict], dict]]) -> dict:
    times, reasons = [], {}
    for msgs, headers in requests:
        dt, d = timed(router, {"model": "m", "messages": msgs}, headers)
        times.append(dt)
        reasons[d.reason] = reasons.get(d.reason, 0) + 1
    return {"p50_us": pct(times, 0.5), "p99_us": pct(times, 0.99),
            "mean_us": statistics.fmean(times) * 1e6, "n": len(times), "reasons": reasons}


def pressed(router: Router, convs: list[list[dict]]) -> dict:
    """default/pressed: the instance holding the most sessions evicts blocks nobody uses (its
    pressure > 0; every other instance holds a block and evicts none), then its sessions send
    one more turn each."""
    homes = Counter(router.policy.sticky.get(f"s{s}") for s in range(len(convs)))
    home = homes.most_common(1)[0][0]
    for inst in router.instances.instances:
        router.index.store(inst.name, [b"other-" + inst.name.encode()])
    junk = [b"junk%d" % i for i in range(64)]
    router.index.store(home, junk)
    router.index.apply(home, KVEventBatch(ts=0.0, events=[
        BlockRemoved(block_hashes=junk, medium=MEDIUM_GPU)]))
    mine = [s for s in range(len(convs)) if router.policy.sticky.get(f"s{s}") == home]
    return measure(router, [(next_turn(next_turn(convs[s], s), s), {"x-session-id": f"s{s}"})
                            for s in mine])


def run(args) -> dict:
    """The paths of the module doc, each over every session (cold: over --cold of them)."""
    results = {}
    convs = [conversation(s, args.turns, args.filler) for s in range(args.sessions)]
    for policy in ("default", "kv_aware"):
        router = make_router(policy, args.tokenizer, args.instances, args.block_size)
        # warm: each session's current history routed once, its prefix cached on its home
        for s, msgs in enumerate(convs):
            body = {"model": "m", "messages": msgs}
            _, d = timed(router, body, {"x-session-id": f"s{s}"})
            router.index.store(d.instance.name, router.keys.keys("chat", body, f"s{s}")[1])
        results[f"{policy}/turn"] = measure(router, [
            (next_turn(m, s), {"x-session-id": f"s{s}"}) for s, m in enumerate(convs)])
        results[f"{policy}/fork"] = measure(router, [
            (fork(m, s), {"x-session-id": f"sub{s}", "x-parent-session-id": f"s{s}"})
            for s, m in enumerate(convs)])
        if policy == "default":
            results["default/pressed"] = pressed(router, convs)
            results["default/cold"] = measure(router, [
                (m, {"x-session-id": f"cold{s}"}) for s, m in enumerate(convs[:args.cold])])
    prompt_tokens = len(make_router("kv_aware", args.tokenizer, 1, args.block_size).keys.keys(
        "chat", {"messages": convs[0]}, None)[0])
    return {"cpu": host_info()["cpu"], "sessions": args.sessions, "instances": args.instances,
            "prompt_tokens": prompt_tokens, "block_size": args.block_size,
            "tokenizer": os.path.relpath(args.tokenizer, os.path.dirname(HERE)),
            "date": time.strftime("%Y-%m-%d"), "load_avg_1m": os.getloadavg()[0],
            "results": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=1000)
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--filler", type=int, default=60, help="key=value pairs per tool result")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cold", type=int, default=100, help="new sessions timed (full encode)")
    p.add_argument("--tokenizer", default=os.path.join(HERE, "..", "tests", "fixtures",
                                                       "tiny-agent"))
    p.add_argument("--out", default=os.path.join(HERE, "results", "router_overhead.json"))
    args = p.parse_args()
    report = run(args)
    for name, r in report["results"].items():
        print(f"{name:16s} p50 {r['p50_us']:8.1f} us  p99 {r['p99_us']:8.1f} us  "
              f"reasons {r['reasons']}")
    print(f"{report['sessions']} sessions, {report['prompt_tokens']} prompt tokens, "
          f"{report['cpu']}")
    write_json(args.out, report)


if __name__ == "__main__":
    main()
