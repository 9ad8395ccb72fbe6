"""Async scheduling (--async-scheduling) against the synchronous step loop: engine step time at
64 decoding streams, and the host share of the step.

Per model, two engines in this process (LLM, the core stepped here as LLM.generate steps it),
one with and one without the flag; rounds alternate between them. Each round adds --streams
greedy requests (prompts of --prompt-len tokens, --max-tokens new tokens each, ignore_eos)
and steps the core until all finish. Reported per engine, medians over rounds of: the median
wall time of one EngineCore.step() over the round's steps after the first --skip (the prefill
and ramp), generated tokens per second over the whole round, and the host share of a step:
the core thread's seconds outside the model, over the step's wall time (synchronous: the step
minus execute_model; async: the step minus the time the core thread waited for the step in
flight, so work it overlapped with execution does not count), the median of its per-step values. Greedy outputs of both engines
are compared every round. The load average is recorded before and after: the host is shared.

    LOOMSERVE_NUM_THREADS=1 python benchmarks/async_scheduling.py --model tiny-llama
    LOOMSERVE_NUM_THREADS=1 python benchmarks/async_scheduling.py --model default --max-tokens 24
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common.results import write_json  # noqa: E402

from loomserve import LLM, SamplingParams  # noqa: E402
from loomserve.engine.messages import EngineCoreRequest  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "tiny-llama")


class TimedExecute:
    """Wraps the synchronous core's execute_model to add up its seconds."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, inp):
        t0 = time.perf_counter()
        try:
            return self.fn(inp)
        finally:
            self.seconds += time.perf_counter() - t0


def make(model: str, async_scheduling: bool, kv: str) -> LLM:
    kw = dict(async_scheduling=async_scheduling, kv_cache_memory=kv, max_num_seqs=256)
    if model == "tiny-llama":
        return LLM(FIXTURE, dtype="float32", **kw)
    return LLM(None if model == "default" else model, **kw)


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    return [[(97 * i + 31 * j) % (vocab - 10) + 5 for j in range(length)] for i in range(n)]


def one_round(llm: LLM, tag: str, ps: list[list[int]], max_tokens: int, skip: int) -> dict:
    """Run every prompt to the end, stepping the core; per-step times and outputs."""
    core = llm.core
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(ps):
        core.add(EngineCoreRequest(request_id=f"{tag}-{i}", prompt_token_ids=p, sampling=sp,
                                   max_tokens=max_tokens))
    timer = core.overlap if core.overlap is not None else core.executor.execute_model
    outside0 = timer.wait_s if core.overlap is not None else timer.seconds
    steps, outside, out = [], [], {f"{tag}-{i}": [] for i in range(len(ps))}
    t_start = time.perf_counter()
    while core.has_work():
        t0 = time.perf_counter()
        for o in core.step():
            out[o.request_id] += o.new_token_ids
        steps.append(time.perf_counter() - t0)
        model_s = timer.wait_s if core.overlap is not None else timer.seconds
        outside.append(steps[-1] - (model_s - outside0))
        outside0 = model_s
    wall = time.perf_counter() - t_start
    tokens = sum(len(v) for v in out.values())
    st, ho = steps[skip:], outside[skip:]
    return {"step_ms": 1e3 * statistics.median(st), "tok_per_s": tokens / wall,
            "host_ms": 1e3 * statistics.median(ho),
            "host_share": statistics.median(h / s for h, s in zip(ho, st)),
            "steps": len(steps), "outputs": [out[f"{tag}-{i}"] for i in range(len(ps))]}


def run_model(model: str, args) -> dict:
    engines = {"sync": make(model, False, args.kv_cache_memory),
               "async": make(model, True, args.kv_cache_memory)}
    engines["sync"].core.executor.execute_model = TimedExecute(
        engines["sync"].core.executor.execute_model)
    ps = prompts(args.streams, args.prompt_len, engines["sync"].core.runner.vocab_size)
    rounds: dict[str, list[dict]] = {k: [] for k in engines}
    identical = True
    for r in range(args.rounds + 1):  # round 0 warms both up and is not kept
        got = {}
        for name in (("sync", "async") if r % 2 else ("async", "sync")):
            res = one_round(engines[name], f"r{r}{name}", ps, args.max_tokens, args.skip)
            got[name] = res.pop("outputs")
            if r:
                rounds[name].append(res)
            print(f"{model} round {r} {name}: step {res['step_ms']:.2f} ms, host "
                  f"{res['host_ms']:.2f} ms ({100 * res['host_share']:.0f}%), "
                  f"{res['tok_per_s']:.0f} tok/s", flush=True)
        identical &= got["sync"] == got["async"]
    for llm in engines.values():
        llm.close()
    summary = {}
    for name, rs in rounds.items():
        summary[name] = {k: statistics.median(x[k] for x in rs)
                         for k in ("step_ms", "tok_per_s", "host_ms", "host_share")}
        summary[name]["runs_step_ms"] = [x["step_ms"] for x in rs]
        summary[name]["runs_tok_per_s"] = [x["tok_per_s"] for x in rs]
        summary[name]["runs_host_share"] = [x["host_share"] for x in rs]
    return {"model": model, "greedy_identical": identical, **summary}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", default=["tiny-llama", "default"],
                   help="tiny-llama (the test fixture), default (the built-in model) or a path")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--skip", type=int, default=3, help="first steps of a round not timed")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--out", default="async_scheduling.json")
    args = p.parse_args()
    os.environ.setdefault("LOOMSERVE_NUM_THREADS", "1")
    load_before = os.getloadavg()
    models = [run_model(m, args) for m in args.model]
    path = write_json(args.out, {
        "streams": args.streams, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "rounds": args.rounds, "torch_threads": int(os.environ["LOOMSERVE_NUM_THREADS"]),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "models": models})
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
