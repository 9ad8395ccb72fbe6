"""Which model, in which dtype, on which device."""

from __future__ import annotations

import os
from dataclasses import dataclass

# Names, not torch dtypes: the front end reads the config without importing torch.
DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class ModelConfig:
    model: str | None = None  # HF folder or .gguf file; None = built-in SmolLM2-135M-Instruct
    served_model_name: str | None = None
    dtype: str = "float32"
    device: str = "auto"  # "auto" picks cuda when present
    seed: int = 0
    max_model_len: int | None = None  # None = the model's own limit
    cache_dir: str | None = None  # converted-weight cache; default ~/.cache/loomserve

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    @property
    def torch_device(self):
        import torch
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def resolved_cache_dir(self) -> str:
        return self.cache_dir or os.environ.get(
            "LOOMSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "loomserve"))
