"""Executors: the engine core's handle on the worker ranks. make_executor picks:
one rank -> UniProcExecutor (uniproc.py: in the core's process);
more -> MultiprocExecutor (multiproc.py: rank 0 in the core's process, one worker process per
other rank)."""

from __future__ import annotations

import os

from loomserve.config import EngineConfig
from loomserve.engine.executor.abstract import Executor
from loomserve.engine.executor.multiproc import MultiprocExecutor
from loomserve.engine.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "MultiprocExecutor", "UniProcExecutor", "make_executor"]


def make_executor(config: EngineConfig) -> Executor:
    """The executor for the config's world size (LOOMSERVE_EXECUTOR=mp forces the multi-process
    one at one rank, for measuring its overhead)."""
    if config.parallel.world_size == 1 and os.environ.get("LOOMSERVE_EXECUTOR") != "mp":
        return UniProcExecutor(config)
    return MultiprocExecutor(config)
