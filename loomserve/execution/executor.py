"""The executor: how a step's ModelInput reaches the model on every rank.

One worker per rank, each owning a ModelRunner (model weights, its shard of the paged KV
buffer, the sampler). The engine core only calls execute_model / check_health / shutdown, so
how ranks are laid out stays behind this seam. Invariant: execute_model returns the sampled
tokens of the driver rank (rank 0), the only rank that samples. make_executor picks:
one rank -> UniProcExecutor (in the core's process; no step message, no collective);
more -> MultiprocExecutor (loomserve.execution.parallel.multiproc_executor: rank 0 in the
core's process, one worker process per other rank).
"""

from __future__ import annotations

import os

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


class Executor:
    """The engine core's only way to the model. `driver_runner` is rank 0's runner: its KV
    config sizes the KV manager and its KV buffer is what the tiers read and write."""

    driver_runner: ModelRunner

    def execute_model(self, model_input: ModelInput) -> ModelOutput:
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a rank is gone (cheap: for the core's idle loop; a step checks anyway)."""

    def shutdown(self) -> None:
        pass


class UniProcExecutor(Executor):
    """One worker, in the calling process (the engine core's)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.world_size != 1:
            raise ValueError("UniProcExecutor runs one rank")
        self.worker = Worker(config)
        self.driver_runner = self.worker.runner

    def execute_model(self, model_input: ModelInput) -> ModelOutput:
        return self.worker.execute_model(model_input)


def make_executor(config: EngineConfig) -> Executor:
    """The executor for the config's world size (LOOMSERVE_EXECUTOR=mp forces the multi-process
    one at one rank, for measuring its overhead)."""
    if config.parallel.world_size == 1 and os.environ.get("LOOMSERVE_EXECUTOR") != "mp":
        return UniProcExecutor(config)
    from loomserve.execution.parallel.multiproc_executor import MultiprocExecutor
    return MultiprocExecutor(config)
