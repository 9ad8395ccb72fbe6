"""The executor: how a step's ModelInput reaches the model on every rank.

One worker per rank (loomserve.execution.worker), each owning a ModelRunner. The engine core
only calls execute_model / check_health / shutdown, so how ranks are laid out stays behind this
seam. Invariant: execute_model returns the sampled tokens of the driver rank (rank 0), the only
rank that samples.
"""

from __future__ import annotations

from loomserve.execution.batch import ModelInput, ModelOutput
from loomserve.execution.model_runner import ModelRunner


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
