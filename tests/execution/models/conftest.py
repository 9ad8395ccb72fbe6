"""Shared helpers for the execution-plane tests: fixture runners, the HF oracle, a block allocator."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from loomserve.config import EngineConfig
from loomserve.execution.batch import ModelInput, ScheduledSeq
from loomserve.sampling_params import SamplingParams

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
TINY_MODELS = ["tiny-llama", "tiny-qwen3"]
GREEDY = SamplingParams(temperature=0.0)

# On a small shared host, OpenMP threads that wait on descheduled siblings make every op take a
# scheduler quantum; one thread is many times faster there.
if (os.cpu_count() or 1) <= 2:
    torch.set_num_threads(1)


def tiny_runner(name: str, block_size: int = 4, dtype: str = "float32", attention_backend: str = "auto"):
    from loomserve.execution.model_runner import ModelRunner

    return ModelRunner(EngineConfig.from_kwargs(model=str(FIXTURES / name), dtype=dtype, device="cpu",
                                    block_size=block_size, kv_cache_memory="2MB",
                                    attention_backend=attention_backend))


class Blocks:
    """Hands out fresh block ids, enough to cover `n` tokens, growing a table in place."""

    def __init__(self, block_size: int) -> None:
        self.block_size, self.next = block_size, 0

    def cover(self, table: list[int], n: int) -> list[int]:
        while len(table) * self.block_size < n:
            table.append(self.next)
            self.next += 1
        return table


def seq(rid: str, tokens: list[int], start: int, table: list[int], sample: bool = True,
        params: SamplingParams = GREEDY, num_out: int = 0) -> ScheduledSeq:
    return ScheduledSeq(rid, list(tokens), start, [table], sample, params, num_out)


def logits_of(runner, seqs: list[ScheduledSeq]) -> dict[str, torch.Tensor]:
    due, logits = runner.compute_logits(ModelInput(seqs))
    return {s.request_id: row for s, row in zip(due, logits)}


@pytest.fixture(scope="module", params=TINY_MODELS)
def tiny(request):
    """(runner, HF reference model) for one tiny fixture."""
    from transformers import AutoModelForCausalLM

    name = request.param
    ref = AutoModelForCausalLM.from_pretrained(str(FIXTURES / name), dtype=torch.float32).eval()
    return tiny_runner(name), ref


def ref_logits(ref, tokens: list[int]) -> torch.Tensor:
    """HF logits for every position of `tokens` ([len, vocab])."""
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()
