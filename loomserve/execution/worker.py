"""One rank of the worker: a device and its ModelRunner (weights, its shard of the paged KV
buffer, the sampler). The engine's executors drive workers; worker processes (parallel/
worker_proc.py) wrap one each for ranks 1.."""

from __future__ import annotations

from loomserve.config import EngineConfig
from loomserve.execution.batch import ModelInput, ModelOutput
from loomserve.execution.model_runner import ModelRunner


class Worker:
    """One rank: a device, its ModelRunner."""

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.rank = rank
        self.runner = ModelRunner(config)

    def execute_model(self, model_input: ModelInput) -> ModelOutput:
        return self.runner.execute(model_input)
