"""Which model, in which dtype, on which device."""

from __future__ import annotations

import os
from dataclasses import dataclass

from loomserve.config.hf_overrides import parse_hf_overrides

# Names, not torch dtypes: the front end reads the config without importing torch.
DTYPES = ("auto", "bfloat16", "float16", "float32")
# auto: the checkpoint's own format where it runs in place (a GGUF file's blocks on a CPU, one
# device), else none; none: the checkpoint's weights as they are (a GGUF or FP8 checkpoint
# dequantized once at load); gguf: keep a GGUF file's own quantized blocks; int8 / int4: quantize a 16/32-bit checkpoint at
# load (weight-only, groups of 32; loomserve/execution/layers/quant.py); fp8: e4m3 weights with
# per-row scales, fp8 x fp8 products on GPUs that have them (layers/fp8.py).
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4", "fp8")
# auto: the in-place paged kernels where the device has them (CPU: the C kernel; CUDA: Triton),
# else torch.
ATTENTION_BACKENDS = ("auto", "cpu_paged", "triton", "torch")


@dataclass
class ModelConfig:
    model: str | None = None  # HF folder, .gguf file, hub id; None: the built-in SmolLM2
    served_model_name: str | None = None
    # A hub id's (execution/models/loading/hub.py): the branch, tag or commit, and the hub
    # cache to use (None: huggingface_hub's, HF_HUB_CACHE / HF_HOME).
    revision: str | None = None
    download_dir: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU (AVX2 hosts run bf16 slowly)
    quantization: str = "auto"  # resolved at load (loading/loader.py: resolve_quantization)
    attention_backend: str = "auto"
    # Capture decode steps as CUDA graphs (execution/cuda_graphs.py). Off until measured on a GPU.
    cuda_graphs: bool = False
    device: str = "auto"  # "auto" picks cuda when present
    seed: int = 0
    max_model_len: int | None = None  # None = the model's own limit
    # Merged into the model's HF config dict before it is parsed (config/hf_overrides.py); a
    # JSON string is parsed here. RoPE scaling here is what lets max_model_len pass the
    # trained context (arch_config.context_length).
    hf_overrides: dict | None = None
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
        self.hf_overrides = parse_hf_overrides(self.hf_overrides)

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
