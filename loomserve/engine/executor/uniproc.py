"""UniProcExecutor: one rank, in the engine core's own process (no step message, no
collective)."""

from __future__ import annotations

from loomserve.config import EngineConfig
from loomserve.engine.executor.abstract import Executor
from loomserve.execution.batch import ModelInput, ModelOutput
from loomserve.execution.worker import Worker


class UniProcExecutor(Executor):
    """One worker, in the calling process (the engine core's)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.world_size != 1:
            raise ValueError("UniProcExecutor runs one rank")
        self.worker = Worker(config)
        self.driver_runner = self.worker.runner

    def execute_model(self, model_input: ModelInput) -> ModelOutput:
        return self.worker.execute_model(model_input)
