"""Sizing the KV pool on a GPU by profiling the largest step before the pool is allocated.

A fraction F given as kv_cache_memory on CUDA is vLLM's --gpu-memory-utilization: F of the
device's whole memory for this engine. The pool gets F x total - resident - peak, where resident
is what the device holds once the weights are in (weights, CUDA context, other processes) and
peak is what a forward of the largest step allocates on top: the scheduler's token budget
(max_num_batched_tokens, each sequence under max_model_len) spread over up to max_num_seqs
prefills from position 0, every one sampled, run on a probe pool just large enough for it.
Absolute budgets are taken as given; a CPU's pool is sized from host memory (torch records no
peak there), and ranked runs (TP/DCP/PCP) keep the free-memory fraction: their probe would be a
collective step every rank must join.
"""

from __future__ import annotations

import logging

import torch

from loomserve.execution.batch import ModelInput, ScheduledSeq
from loomserve.kv.directives import StateDirective
from loomserve.kv.spec import LinearStateSpec
from loomserve.sampling_params import SamplingParams

log = logging.getLogger("loomserve.execution")
GiB = 1 << 30


def probe_shape(config, max_model_len: int) -> tuple[int, int]:
    """(tokens, sequences) of the largest step the scheduler may form."""
    sched = config.scheduler
    seqs = max(1, min(sched.max_num_seqs, sched.max_num_batched_tokens))
    tokens = min(sched.max_num_batched_tokens, seqs * (max_model_len - 1))
    return max(tokens, seqs), seqs


def probe_input(groups, block_size: int, tokens: int, seqs: int) -> tuple[ModelInput, int]:
    """A step of `tokens` prefill tokens over `seqs` sequences from position 0, each sampled:
    every KV group its own pages (attention: one per block_size tokens; linear state: one,
    zeroed first). Returns it and the number of pages it uses (ids 0 .. n - 1)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    pages, out = 0, []
    for i in range(seqs):
        n = tokens // seqs + (1 if i < tokens % seqs else 0)
        block_ids, states = [], {}
        for g, grp in enumerate(groups):
            if isinstance(grp.spec, LinearStateSpec):
                block_ids.append([pages])
                states[g] = StateDirective(pages, zero_init=True)
                pages += 1
            else:
                count = -(-n // block_size)
                block_ids.append(list(range(pages, pages + count)))
                pages += count
        out.append(ScheduledSeq(f"__profile_{i}", [0] * n, 0, block_ids, True, greedy,
                                states=states))
    return ModelInput(out), pages


def run_probe(runner, tokens: int, seqs: int) -> None:
    """One forward + sample of the probe step on the runner's pool (which must hold its pages);
    leaves no per-request state behind."""
    inp, pages = probe_input(runner.kv_cache_config.groups, runner.block_size, tokens, seqs)
    if pages > runner.kv_cache_config.num_blocks:
        raise ValueError(f"the probe step needs {pages} pages, the pool has "
                         f"{runner.kv_cache_config.num_blocks}")
    runner.execute(inp)
    runner.block_tables.drop([s.request_id for s in inp.seqs])


def probe_pages(runner) -> int:
    """Pages the probe step needs, plus one (a pool is never planned empty)."""
    tokens, seqs = probe_shape(runner.config, runner.max_model_len)
    return probe_input(runner.kv_cache_config.groups, runner.block_size, tokens, seqs)[1] + 1


def activation_peak_bytes(runner) -> int:
    """Bytes the largest step allocates on the device beyond what was resident before it."""
    dev = runner.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    run_probe(runner, *probe_shape(runner.config, runner.max_model_len))
    torch.cuda.synchronize(dev)
    return max(0, torch.cuda.max_memory_allocated(dev) - before)


def pool_budget(runner, fraction: float, probe_bytes: int, peak: int) -> int:
    """The pool's bytes on the runner's device, from its memory now (the probe pool still
    allocated): budget_from(...)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    return budget_from(fraction, total, free, probe_bytes, peak)


def budget_from(fraction: float, total: int, free: int, probe_bytes: int, peak: int) -> int:
    """fraction x total - resident - peak, resident = total - free less the probe pool (it
    goes). ValueError, saying what took the memory, when nothing is left for the pool."""
    resident = total - free - probe_bytes
    budget = int(fraction * total) - resident - peak
    log.info("KV pool by profile: %.2f of %.1f GiB, %.2f GiB resident (weights, runtime), "
             "%.2f GiB peak activations of the largest step -> %.2f GiB for KV", fraction,
             total / GiB, resident / GiB, peak / GiB, budget / GiB)
    if budget <= 0:
        raise ValueError(
            f"kv-cache-memory {fraction:g} of {total / GiB:.1f} GiB leaves no room for the KV "
            f"cache: {resident / GiB:.2f} GiB is resident (weights, runtime) and the largest "
            f"step's activations peak at {peak / GiB:.2f} GiB; raise the fraction or lower "
            f"--max-num-batched-tokens / --max-num-seqs")
    return budget
