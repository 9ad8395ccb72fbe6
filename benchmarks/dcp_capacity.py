"""Decode context parallelism: per-rank KV capacity, a context only D = 2 holds, and the
all-gather volume per decode step.

1. Capacity, read from the engine (not computed by hand) at decode_context_parallel_size 1 and
   2 with the same --kv-cache-memory per rank: runner.kv_cache_config (the scheduler's blocks
   and capacity_tokens) and runner.kv_layout (one rank's pages: what it stores).
2. A prompt of --long-prompt tokens, more than the D = 1 pool holds: refused at D = 1 (the
   engine's max_model_len is the pool's capacity), served at D = 2. Greedy tokens (16 each) of
   four short prompts and one of --compare-len tokens (near the D = 1 pool's size) are
   compared between D = 1 and 2.
3. Communication at D = 2: DcpBackend.gathered_bytes over --steps decode-only steps of
   --streams requests, per attention layer per token, beside the formula
       D x heads x (head_dim + 1) x 4 bytes   (every rank's fp32 partial out + LSE, gathered)
   of which each rank sends heads x (head_dim + 1) x 4 and receives (D - 1) times that
   (MLA: kv_lora_rank in place of head_dim, its decode partials being latent rows).
   Step times at D = 1 and 2 are reported too, indicative only: each DCP rank replicates the
   non-attention work, so on one shared 2-core host DCP buys capacity, not speed.

--tp 2 (MLA models): the same at TP 2 alone (latent cache replicated per rank) against TP 2 x
DCP 2 (the same two ranks also split the latent rows by token); the TP x DCP decode also
all-gathers the heads' latent queries (heads x (kv_lora_rank + rope) x 4 per token and layer,
not counted in the gathered bytes above).

    nice -n -15 python benchmarks/dcp_capacity.py [--model PATH] [--kv-cache-memory 64MiB] [--tp 2]
        [--long-prompt 2500] [--streams 8] [--steps 32] [--out benchmarks/results/dcp_capacity.json]
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

from common.host import host_info  # noqa: E402
from common.results import write_json  # noqa: E402


def _engine(model: str | None, dcp: int, memory: str, tp: int = 1):
    from loomserve.engine.llm import LLM
    return LLM(model, decode_context_parallel_size=dcp, kv_cache_memory=memory, dtype="float32",
               tensor_parallel_size=tp)


def _prompt(i: int, n: int, vocab: int) -> list[int]:
    return [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(n)]


def _capacity(llm) -> dict:
    r = llm.core.runner
    view, pool = r.kv_cache_config, r.kv_layout
    return {"blocks": view.num_blocks, "block_size": view.block_size,
            "capacity_tokens": view.capacity_tokens, "rank_page_bytes": pool.page_bytes,
            "rank_tokens_per_page": pool.block_size, "rank_stored_tokens": pool.capacity_tokens,
            "max_model_len": llm.core.max_model_len}


def _long_prompt(llm, n: int) -> dict:
    """Serve one prompt of n tokens (4 greedy tokens): ok, or the engine's refusal."""
    from loomserve.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    t0 = time.perf_counter()
    try:
        out = llm.generate([_prompt(1, n, llm.core.runner.vocab_size)], sp)[0]
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return {"served": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    if out.finish_reason not in ("length", "stop"):
        return {"served": False, "finish_reason": out.finish_reason}
    return {"served": True, "tokens": out.token_ids, "seconds": time.perf_counter() - t0}


def _decode(llm, streams: int, prompt_len: int, steps: int) -> dict:
    """Median step ms over `steps` decode-only steps, and the all-gathered bytes during them."""
    from loomserve.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    core = llm.core
    for i in range(streams):
        ids = _prompt(i + 2, prompt_len, core.runner.vocab_size)
        core.add(llm.inputs.make_core_request(f"d{i}-{time.monotonic_ns()}", ids, sp))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()):
        core.step()
    core.step()
    attn = core.runner.attention
    before = getattr(attn, "gathered_bytes", 0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    gathered = getattr(attn, "gathered_bytes", 0) - before
    while core.has_work():
        for rid in list(core.scheduler.requests):
            core.abort(rid)
        core.step()
    return {"step_ms_median": statistics.median(times) * 1e3, "gathered_bytes": gathered}


def run(args) -> dict:
    from loomserve.sampling_params import SamplingParams
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out: dict = {"runs": {}}
    for dcp in (1, 2):
        llm = _engine(args.model, dcp, args.kv_cache_memory, args.tp)
        try:
            mc = llm.core.runner.model_config
            layers = sum(len(g.layer_ids) for g in llm.core.runner.kv_cache_config.groups)
            res = {"capacity": _capacity(llm)}
            res["long_prompt"] = _long_prompt(llm, args.long_prompt)
            short = [_prompt(i, 40 + 17 * i, llm.core.runner.vocab_size) for i in range(4)]
            short.append(_prompt(9, args.compare_len, llm.core.runner.vocab_size))
            res["greedy"] = [o.token_ids for o in llm.generate(short, greedy)]
            res["decode"] = _decode(llm, args.streams, args.prompt_len, args.steps)
            per = res["decode"]["gathered_bytes"] / (args.steps * args.streams * layers)
            res["decode"]["gathered_bytes_per_layer_token"] = per
            # MLA gathers its decode partials in latent space: kv_lora_rank + 1 per head
            width = getattr(mc, "kv_lora_rank", None) or mc.head_dim
            # (the runner's model_config is the checkpoint's: every head, as the partials carry)
            res["formula_bytes_per_layer_token"] = dcp * mc.num_heads * (width + 1) * 4 \
                if dcp > 1 else 0
            out["runs"][str(dcp)] = res
            out["model"] = {"name": llm.core.runner.model_name, "layers": layers,
                            "heads": mc.num_heads, "kv_heads": getattr(mc, "num_kv_heads", 1),
                            "head_dim": mc.head_dim}
        finally:
            llm.close()
    one, two = out["runs"]["1"], out["runs"]["2"]
    out["capacity_ratio"] = two["capacity"]["capacity_tokens"] / one["capacity"]["capacity_tokens"]
    out["greedy_identical"] = one["greedy"] == two["greedy"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: built-in SmolLM2)")
    ap.add_argument("--kv-cache-memory", default="64MiB", help="per rank")
    ap.add_argument("--tp", type=int, default=1, help="2: TP 2 alone against TP 2 x DCP 2 "
                    "(MLA models), instead of one rank against DCP 2")
    ap.add_argument("--long-prompt", type=int, default=2500)
    ap.add_argument("--compare-len", type=int, default=1400, help="< the D = 1 capacity")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "dcp_capacity.json"))
    args = ap.parse_args()
    os.environ.setdefault("LOOMSERVE_NUM_THREADS", "1")  # one thread per rank: 2 ranks, 2 cores
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result = run(args)
    result.update(host=host_info(), date=started, args=vars(args),
                  command="nice -n -15 python benchmarks/dcp_capacity.py " + " ".join(sys.argv[1:]),
                  threads_per_rank=int(os.environ["LOOMSERVE_NUM_THREADS"]))
    write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    for d, r in result["runs"].items():
        print(f"D={d}: {r['capacity']}  long prompt served: {r['long_prompt'].get('served')}  "
              f"decode {r['decode']}  formula {r['formula_bytes_per_layer_token']} B")


if __name__ == "__main__":
    main()
