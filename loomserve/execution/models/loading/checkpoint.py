"""Reading an HF folder's safetensors: the (name, tensor) stream load_weights consumes.

FP8 checkpoints (HF `quant_method: fp8` with 128x128 block scales in `weight_scale_inv`, as
DeepSeek-V3 and Qwen3-FP8 ship; compressed-tensors / fbgemm FP8 with per-tensor or per-channel
`weight_scale`) are dequantized here, tensor by tensor: each e4m3/e5m2 `X.weight` is yielded as
fp32 q * scale, its scale tensors are consumed, and static activation / KV scales are dropped
(loomserve quantizes activations dynamically). The model then holds the checkpoint's exact
values in its dtype; `--quantization fp8` re-quantizes them per row (layers/fp8.py).

MXFP4 checkpoints (`quant_method: mxfp4`, gpt-oss's experts as `X_blocks` + `X_scales`) either
load as they are, for a model that runs them in place (mxfp4_in_place: any --quantization but
none), or each pair is yielded as `X`, dequantized exactly (bf16 holds every MXFP4 value) in
transformers' layout, [experts, K, N]. Any other `quantization_config` (GPTQ, AWQ,
bitsandbytes...) is refused by name: its packed tensors would otherwise load as garbage.
"""

from __future__ import annotations

import contextlib
import glob
import os
from typing import Any, Iterator

import torch
from safetensors import safe_open

from loomserve.execution.layers.mxfp4 import dequantize as dequantize_mxfp4

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
WEIGHT_SCALES = (".weight_scale_inv", ".weight_scale")  # multiplied in, whatever the name says
DROPPED = (".input_scale", ".k_scale", ".v_scale")  # static scales: unused with dynamic ones
FP8_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors")
MXFP4_SUFFIXES = ("_blocks", "_scales")
DEFAULT_BLOCK = (128, 128)


def check_quantization_config(hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """None for a plain checkpoint; for an FP8 one the block size its 2-D scales cover (the
    config's weight_block_size / block_structure, else 128x128); ValueError for anything else."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    block = qc.get("weight_block_size")
    if method == "compressed-tensors":
        groups = (qc.get("config_groups") or {}).values()
        weights = [g.get("weights") or {} for g in groups]
        if not (weights and all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights)):
            raise ValueError("only FP8 (float, 8-bit) compressed-tensors checkpoints are supported; "
                             f"this one has weight schemes {weights}")
        block = weights[0].get("block_structure")
    elif method == "mxfp4":
        return None  # no FP8 block; the experts' blocks: iter_safetensors, mxfp4_in_place
    elif method not in FP8_METHODS:
        raise ValueError(f"checkpoint quantization {method!r} is not supported: serve a 16/32-bit or "
                         "FP8 checkpoint (optionally with --quantization int8|int4|fp8), or a .gguf file")
    return (int(block[0]), int(block[1])) if block else DEFAULT_BLOCK


def mxfp4_in_place(hf_config: dict[str, Any], cfg: Any, quantization: str,
                   tp_size: int = 1) -> bool:
    """Whether an MXFP4 checkpoint's experts load as their blocks: the model's config has the
    `mxfp4_experts` switch (gpt-oss) and the user asked for any mode but `none` (`none` widens
    them to --dtype at load), except `auto` (the default) where tensor parallelism would split
    their 32-value blocks (intermediate_size / tp_size not a multiple of 32): it widens them
    then too. The caller sets the switch."""
    qc = hf_config.get("quantization_config") or {}
    if qc.get("quant_method") != "mxfp4" or quantization == "none" or not hasattr(cfg, "mxfp4_experts"):
        return False
    return quantization != "auto" or (cfg.intermediate_size // tp_size) % 32 == 0


def iter_safetensors(folder: str, block: tuple[int, int] | None = None,
                     keep_mxfp4: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's *.safetensors, FP8 weights dequantized (module docstring);
    block: check_quantization_config's answer (None: DEFAULT_BLOCK); keep_mxfp4: MXFP4
    `X_blocks` / `X_scales` yielded as they are (else as `X`, dequantized)."""
    block = block or DEFAULT_BLOCK
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(p, framework="pt", device="cpu")) for p in files]
        where = {key: f for f in handles for key in f.keys()}
        for f in handles:
            for key in f.keys():
                if _consumed(key, where):
                    continue
                if not keep_mxfp4 and _mxfp4_pair(key, where):
                    if key.endswith("_blocks"):
                        yield key[:-len("_blocks")], _dequantize_mxfp4(key, where)
                    continue
                t = f.get_tensor(key)
                if t.dtype in FP8_DTYPES:
                    t = _dequantize(key, t, where, block)
                yield key, t


def _consumed(key: str, where: dict) -> bool:
    """A scale that belongs to a weight (read with it) or a static scale loomserve ignores."""
    for suffix in WEIGHT_SCALES + DROPPED:
        if key.endswith(suffix):
            return suffix in DROPPED or key[:-len(suffix)] + ".weight" in where
    return False


def _mxfp4_pair(key: str, where: dict) -> bool:
    """An MXFP4 `X_blocks` or `X_scales` (uint8) whose partner is in the checkpoint too."""
    for suffix, other in (MXFP4_SUFFIXES, MXFP4_SUFFIXES[::-1]):
        if key.endswith(suffix):
            return key[:-len(suffix)] + other in where and where[key].get_slice(key).get_dtype() == "U8"
    return False


def _dequantize_mxfp4(key: str, where: dict) -> torch.Tensor:
    scales_key = key[:-len("_blocks")] + "_scales"
    blocks = where[key].get_tensor(key)
    scales = where[scales_key].get_tensor(scales_key)
    # bf16 holds every MXFP4 value exactly (a 2-bit significand, fp32's exponent range)
    return dequantize_mxfp4(blocks, scales, torch.bfloat16).transpose(-1, -2).contiguous()


def _dequantize(key: str, q: torch.Tensor, where: dict, block: tuple[int, int]) -> torch.Tensor:
    base = key[:-len(".weight")] if key.endswith(".weight") else key
    scale_key = next((base + s for s in WEIGHT_SCALES if base + s in where), None)
    if scale_key is None:
        raise ValueError(f"FP8 tensor {key!r} has no {base}.weight_scale[_inv] beside it")
    return dequantize_fp8(q, where[scale_key].get_tensor(scale_key), block)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """fp32 q * scale, the scale per tensor (one value), per row ([N] or [N, 1]) or per
    block ([ceil(N/bn), ceil(K/bk)] for block (bn, bk); the last blocks may be partial)."""
    w, s = q.to(torch.float32), scale.to(torch.float32)
    if s.numel() == 1:
        return w * s.reshape(())
    if w.dim() == 2 and s.numel() == w.shape[0] and (s.dim() == 1 or s.shape[-1] == 1):
        return w * s.reshape(-1, 1)
    (bn, bk), shape = block, tuple(s.shape)
    if w.dim() != 2 or shape != (-(-w.shape[0] // bn), -(-w.shape[1] // bk)):
        raise ValueError(f"FP8 scale {shape} fits weight {tuple(w.shape)} neither per tensor, "
                         f"per row nor per {bn}x{bk} block")
    n, k = w.shape
    return w * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
