"""Host CPU time per engine step around the forward pass: scheduler + KV bookkeeping, and the
model runner's input preparation (attention metadata, positions, input ids, state batches).

N requests decode together (prompts of 1-4K tokens by default, or exactly --context tokens;
prefix caching on, block size 16). Each timed step runs, as EngineCore.step() does:
Scheduler.schedule(), then the real ModelRunner.compute_logits() on the scheduled ModelInput
with the model swapped for a stub that returns zeros (so everything the runner does before and
around the forward pass runs, the forward pass does not), then Scheduler.update() with a sampled
token per request. The runner is tests/fixtures/tiny-llama (one full-attention KV group, as
SmolLM2) from a temporary copy whose max_position_embeddings is raised to fit --context, with a
KV pool sized for every request (calloc'd, never touched). Reported per case, medians over
--repeats of the per-repeat median / p99 microseconds per step: `scheduler` (schedule + update),
`runner_prep` (compute_logits with the stub), of which `build_metadata` (attention metadata per
attention group), and `total`. --no-runner times the scheduler alone (the figure before the
runner was added). Target: total < 1 ms at 32 running requests.

    python benchmarks/scheduler_step.py [--running 32 64] [--steps 2000] [--repeats 5]
    python benchmarks/scheduler_step.py --running 64 --context 131072 --steps 40   # long context
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from loomserve.config import EngineConfig
from loomserve.engine.sched.request import Request
from loomserve.engine.sched.scheduler import Scheduler
from loomserve.execution import model_runner as model_runner_mod
from loomserve.execution.model_runner import ModelRunner
from loomserve.kv.cache_manager import KVCacheManager
from loomserve.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.results import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "tiny-llama")
BLOCK_SIZE = 16
VOCAB = 50_000


class StubModel:
    """Stands in for the model in ModelRunner.compute_logits: no forward pass, zeros out."""

    def __call__(self, input_ids, positions, attn_meta, state_batch):
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden):
        return hidden


class TimedBuildMetadata:
    """Wraps model_runner.build_metadata to add up its time within a step."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def model_copy(max_positions: int, tmp: str) -> str:
    """The tiny-llama fixture with max_position_embeddings >= max_positions (weights linked)."""
    dst = os.path.join(tmp, "tiny-llama")
    os.makedirs(dst)
    for name in os.listdir(FIXTURE):
        src = os.path.join(FIXTURE, name)
        if name == "config.json":
            with open(src) as f:
                cfg = json.load(f)
            cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], max_positions)
            with open(os.path.join(dst, name), "w") as f:
                json.dump(cfg, f)
        else:
            try:
                os.symlink(src, os.path.join(dst, name))
            except OSError:
                shutil.copy(src, dst)
    return dst


def make_runner(model: str, tokens: int, dtype: str) -> ModelRunner:
    """A CPU runner whose KV pool holds `tokens` tokens (plus slack)."""
    def build(kv_bytes: int) -> ModelRunner:
        return ModelRunner(EngineConfig.from_kwargs(model=model, device="cpu", dtype=dtype,
                                                    block_size=BLOCK_SIZE,
                                                    kv_cache_memory=kv_bytes))
    probe = build(1 << 20)
    page = probe.kv_cache_config.page_bytes
    del probe
    blocks = tokens // BLOCK_SIZE + 256
    return build(blocks * page)


def run_once(running: int, steps: int, seed: int, context: tuple[int, int],
             runner: ModelRunner | None) -> dict[str, list[float]]:
    rng = np.random.default_rng(seed)
    if runner is not None:
        kv = KVCacheManager(runner.kv_cache_config)  # as EngineCore builds it
    else:
        from loomserve.kv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=3, head_dim=64,
                                 dtype=torch.bfloat16)
        kv = KVCacheManager(KVCacheConfig(
            num_blocks=running * (context[1] + steps) // BLOCK_SIZE + 64,
            groups=(KVCacheGroup(spec, tuple(range(30))),)))
    sched = Scheduler(kv, max_num_batched_tokens=max(1 << 20, running * context[1]),
                      max_num_seqs=running, long_prefill_threshold=0)
    params = SamplingParams(temperature=0, max_tokens=steps + 10, ignore_eos=True)
    for i in range(running):
        n = int(rng.integers(context[0], context[1] + 1))
        sched.add(Request(f"r{i}", rng.integers(0, VOCAB, n).tolist(), params, params.max_tokens))
    ids = [f"r{i}" for i in range(running)]
    out = sched.schedule()  # the prefill step, not timed
    sched.update(out, dict.fromkeys(ids, 1))
    timer = None
    if runner is not None:
        runner.model = StubModel()
        timer = TimedBuildMetadata(model_runner_mod.build_metadata)
        model_runner_mod.build_metadata = timer
    times: dict[str, list[float]] = {"scheduler": [], "runner_prep": [], "build_metadata": [],
                                     "total": []}
    try:
        for _ in range(steps):
            sampled = dict(zip(ids, rng.integers(0, VOCAB, running).tolist()))
            t0 = time.perf_counter()
            out = sched.schedule()
            t1 = time.perf_counter()
            if runner is not None:
                timer.seconds = 0.0
                runner.compute_logits(out.model_input)
            t2 = time.perf_counter()
            sched.update(out, sampled)
            t3 = time.perf_counter()
            times["scheduler"].append((t1 - t0) + (t3 - t2))
            times["total"].append(t3 - t0)
            if runner is not None:
                times["runner_prep"].append(t2 - t1)
                times["build_metadata"].append(timer.seconds)
    finally:
        if timer is not None:
            model_runner_mod.build_metadata = timer.fn
    assert len(out.scheduled) == running
    return {k: v for k, v in times.items() if v}


def summarize(reps: list[dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    out = {}
    for key in reps[0]:
        meds, p99s = [], []
        for r in reps:
            t = sorted(r[key])
            meds.append(statistics.median(t) * 1e6)
            p99s.append(t[min(len(t) - 1, int(len(t) * 0.99))] * 1e6)
        out[key] = {"median_us": round(statistics.median(meds), 1),
                    "p99_us": round(statistics.median(p99s), 1),
                    "repeat_medians_us": [round(m, 1) for m in meds]}
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--context", type=int, default=None,
                    help="every prompt exactly this many tokens (default: 1024-4096 at random)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", help="the runner's dtype (mask dtype)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's, as the engine without "
                         "LOOMSERVE_NUM_THREADS)")
    ap.add_argument("--no-runner", dest="runner", action="store_false",
                    help="time schedule() + update() only, no model runner")
    ap.add_argument("--out", default="scheduler_step.json", help="result file")
    args = ap.parse_args()
    context = (args.context, args.context) if args.context else (1024, 4096)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        model = model_copy(context[1] + args.steps + 64, tmp) if args.runner else None
        for running in args.running:
            runner = None
            if model is not None:
                runner = make_runner(model, running * (context[1] + args.steps + BLOCK_SIZE),
                                     args.dtype)
            reps = []
            for r in range(args.repeats):
                reps.append(run_once(running, args.steps, r, context, runner))
            cases.append({"running": running, "context_tokens": list(context),
                          "per_step": summarize(reps)})
            del runner
    result = {"steps": args.steps, "repeats": args.repeats, "block_size": BLOCK_SIZE,
              "runner": "tiny-llama fixture, model stubbed" if args.runner else None,
              "dtype": args.dtype if args.runner else None, "cases": cases,
              "torch_threads": torch.get_num_threads(), "cpu": _cpu_model(),
              "loadavg_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
              "target_us": 1000, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for c in cases:
        ps = c["per_step"]
        line = ", ".join(f"{k} {v['median_us']:.0f} us (p99 {v['p99_us']:.0f})"
                         for k, v in ps.items())
        print(f"{c['running']} running, context {c['context_tokens'][0]}-"
              f"{c['context_tokens'][1]}: {line}", file=sys.stderr)
    print(json.dumps(result))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
