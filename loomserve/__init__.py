"""loomserve: an LLM serving engine for agentic traffic."""

from loomserve.sampling_params import SamplingParams, StructuredOutputs

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy, so `import loomserve` (the CLI, the bench tools) does not load torch and the model code.
    if name == "LLM":
        from loomserve.engine.llm import LLM
        return LLM
    if name == "EngineConfig":
        from loomserve.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
