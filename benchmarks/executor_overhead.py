"""Executor overhead and tensor-parallel communication per decode step.

1. Step overhead: the same engine (LLM, core stepped in this process) decoding --streams
   requests, timed per EngineCore.step(), with today's UniProcExecutor and with the
   MultiprocExecutor at one rank (LOOMSERVE_EXECUTOR=mp: the step message is built and encoded
   every step, as at N ranks, but there is no peer to send it to). Runs alternate between the
   two (--repeats each); reported: median step ms per run, and the overhead of the medians.
   Target: < 5% at 32 streams. Whole steps are noisy on a shared host, so the message's own
   cost (build + encode, microseconds per step) is also measured alone (`message`).
2. Communication at --tp ranks (default 2): rank 0's collectives counted during the same decode
   steps (all-reduce payload bytes, gathered logit bytes, step-message bytes), beside the
   formula for a decode step of B streams, L layers, hidden H, vocabulary V, fp32 activations:
       all-reduce payload  (2L + 1) * B * H * 4     (o_proj + down_proj per layer, embedding)
       logit gather        (N - 1) * B * ceil(V / N) * 4   into rank 0
       step message        msgpack(B seqs: id, 1 token, position, flags, new block ids), sent
                           in one 4 KiB broadcast (8-byte length + message) up to 4088 bytes
   A ring all-reduce moves 2 (N - 1) / N of its payload per rank; gloo picks its algorithm.

    nice -n -15 python benchmarks/executor_overhead.py [--model PATH] [--streams 32]
        [--steps 64] [--repeats 5] [--tp 2] [--out benchmarks/results/executor_overhead.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
FIXTURE = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "tiny-llama")

from common.host import host_info  # noqa: E402
from common.results import write_json  # noqa: E402


def _engine(model: str, tp: int, executor: str | None, streams: int, prompt_len: int):
    from loomserve.engine.llm import LLM
    if executor:
        os.environ["LOOMSERVE_EXECUTOR"] = executor
    else:
        os.environ.pop("LOOMSERVE_EXECUTOR", None)
    llm = LLM(None if model == "default" else model,  # "default": the built-in SmolLM2
              tensor_parallel_size=tp, kv_cache_memory="256MiB", dtype="float32")
    os.environ.pop("LOOMSERVE_EXECUTOR", None)
    return llm


def _decode_steps(llm, streams: int, prompt_len: int, steps: int, before=None,
                  after=None) -> list[float]:
    """Seconds per core step over `steps` decode-only steps of `streams` requests (`before`
    is called just before the first of them)."""
    from loomserve.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    vocab = llm.core.runner.vocab_size
    for i in range(streams):
        ids = [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(prompt_len)]
        llm.core.add(llm.inputs.make_core_request(f"b{i}-{time.monotonic_ns()}", ids, sp))
    core = llm.core
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in core.scheduler.requests.values()):
        core.step()  # prefill (chunked as the scheduler likes)
    core.step()
    if before is not None:
        before()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    if after is not None:
        after()
    while core.has_work():
        for rid in list(core.scheduler.requests):
            core.abort(rid)
        core.step()
    return times


def overhead(args) -> dict:
    runs: dict[str, list[float]] = {"uniproc": [], "multiproc_tp1": []}
    for _ in range(args.repeats):
        for name, executor in (("uniproc", None), ("multiproc_tp1", "mp")):
            llm = _engine(args.model, 1, executor, args.streams, args.prompt_len)
            try:
                t = _decode_steps(llm, args.streams, args.prompt_len, args.steps)
            finally:
                llm.close()
            runs[name].append(statistics.median(t) * 1e3)
    uni, mp = statistics.median(runs["uniproc"]), statistics.median(runs["multiproc_tp1"])
    return {"step_ms_runs": runs, "uniproc_step_ms": uni, "multiproc_tp1_step_ms": mp,
            "overhead_pct": 100.0 * (mp - uni) / uni, "target_pct": 5.0}


def message_cost(args, steps: int = 2000) -> dict:
    """Microseconds per step to build and encode the step message of --streams decoding
    requests (each past --prompt-len tokens, a block appended every 16 steps): the driver's
    only added work at one rank, measured without the noise of whole steps."""
    from loomserve.execution.batch import ModelInput, ScheduledSeq
    from loomserve.execution.parallel.step_message import BlockSyncSender, encode
    from loomserve.sampling_params import SamplingParams
    sp = SamplingParams()
    tables = [[list(range(i * 1000, i * 1000 + args.prompt_len // 16 + 1))]
              for i in range(args.streams)]
    sender, size, spent = BlockSyncSender(), 0, 0.0
    for step in range(steps):
        seqs = []
        for i, t in enumerate(tables):
            if step % 16 == i % 16:
                t[0].append(t[0][-1] + 1)
            seqs.append(ScheduledSeq(f"req-{i}", [step % 500], args.prompt_len + step, t, True,
                                     sp))
        inp = ModelInput(seqs)
        t0 = time.perf_counter()
        size += len(encode(sender.message(inp)))
        spent += time.perf_counter() - t0
    return {"us_per_step": spent / steps * 1e6,
            "bytes_per_step": size / steps, "streams": args.streams}


class _Counter:
    """Counts the payload bytes of rank 0's collectives (wraps torch.distributed's calls)."""

    def __init__(self) -> None:
        import torch.distributed as dist
        self.dist, self.counts = dist, {"all_reduce": 0, "gather": 0, "broadcast": 0}
        self.saved = {k: getattr(dist, k) for k in self.counts}
        for k in self.counts:
            setattr(dist, k, self._wrap(k, self.saved[k]))

    def _wrap(self, name, fn):
        def counted(tensor, *a, **kw):
            n = tensor.numel() * tensor.element_size()
            if name == "gather":
                out = a[0] if a else kw.get("gather_list")
                n = sum(t.numel() * t.element_size() for t in out[1:]) if out else n
            self.counts[name] += n
            return fn(tensor, *a, **kw)
        return counted

    def reset(self) -> None:
        self.counts = dict.fromkeys(self.counts, 0)

    def close(self) -> None:
        for k, fn in self.saved.items():
            setattr(self.dist, k, fn)


def communication(args) -> dict:
    counter = _Counter()
    llm = _engine(args.model, args.tp, None, args.streams, args.prompt_len)
    try:
        mc = llm.core.runner.model_config
        _decode_steps(llm, args.streams, args.prompt_len, 4)  # warm: block tables sent whole
        ex = llm.core.executor
        mark = {}

        def start() -> None:
            counter.reset()
            mark["sent"] = ex.bytes_sent

        def stop() -> None:
            mark["counts"] = dict(counter.counts)
            mark["sent"] = ex.bytes_sent - mark["sent"]
        t = _decode_steps(llm, args.streams, args.prompt_len, args.steps, start, stop)
        measured = {k: v / args.steps for k, v in mark["counts"].items()}
        msg = mark["sent"] / args.steps
    finally:
        llm.close()
        counter.close()
    b, n = args.streams, args.tp
    formula = {"all_reduce": (2 * mc.num_layers + 1) * b * mc.hidden_size * 4,
               "gather": (n - 1) * b * -(-mc.vocab_size // n) * 4}
    return {"tp": n, "streams": b, "layers": mc.num_layers, "hidden": mc.hidden_size,
            "vocab": mc.vocab_size, "step_ms_median": statistics.median(t) * 1e3,
            "measured_bytes_per_step": measured, "step_message_bytes_per_step": msg,
            "formula_bytes_per_step": formula,
            "note": "rank 0's payload bytes per decode step, summed over the timed steps and "
                    "divided by their count; broadcast = the fixed 4 KiB first broadcast of the "
                    "step message (+ the rest of a longer one)"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=FIXTURE, help="a model path, or 'default' (SmolLM2-135M)")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "results", "executor_overhead.json"))
    args = p.parse_args()
    os.environ.setdefault("LOOMSERVE_NUM_THREADS", "1")
    result = {"command": " ".join(sys.argv), "date": datetime.datetime.now(
                  datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": host_info(), "model": args.model,
              "threads_per_rank": int(os.environ["LOOMSERVE_NUM_THREADS"]),
              "message": message_cost(args), "overhead": overhead(args)}
    if args.tp > 1:
        result["communication"] = communication(args)
    print(json.dumps(result, indent=2))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
