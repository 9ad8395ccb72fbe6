"""Which model, in which dtype, on which device."""

from __future__ import annotations

import os
from dataclasses import dataclass

# Names, not torch dtypes: the front end reads the config without importing torch.
DTYPES = ("auto", "bfloat16", "float16", "float32")
# none: the checkpoint's weights as they are (a GGUF or FP8 checkpoint dequantized once at load);
# gguf: keep a GGUF file's own quantized blocks; int8 / int4: quantize a 16/32-bit checkpoint at
# load (weight-only, groups of 32; loomserve/execution/layers/quant.py); fp8: e4m3 weights with
# per-row scales, fp8 x fp8 products on GPUs that have them (layers/fp8.py).
QUANTIZATIONS = ("none", "gguf", "int8", "int4", "fp8")
# auto: the in-place paged kernels where the device has them (CPU: the C kernel; CUDA: Triton),
# else torch.
ATTENTION_BACKENDS = ("auto", "cpu_paged", "triton", "torch")


@dataclass
class ModelConfig:
    model: str | None = None  # HF folder or .gguf file; None = built-in SmolLM2-135M-Instruct
    served_model_name: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU (AVX2 hosts run bf16 slowly)
    quantization: str = "none"
    attention_backend: str = "auto"
    # Capture decode steps as CUDA graphs (execution/cuda_graphs.py). Off until measured on a GPU.
    cuda_graphs: bool = False
    device: str = "auto"  # "auto" picks cuda when present
    seed: int = 0
    max_model_len: int | None = None  # None = the model's own limit
    cache_dir: str | None = None  # converted-weight cache; default ~/.cache/loomserve

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")

    @property
    def resolved_dtype(self) -> str:
        """The dtype name in use: `auto` resolved against the device."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.torch_device.type == "cuda" else "float32"

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.resolved_dtype)

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
