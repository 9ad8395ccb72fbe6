"""load_model: an HF folder, a .gguf file, or None (the built-in default) -> the model.

The tokenizer is the front end's (loomserve.engine.tokenizer), read from the same folder."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from loomserve.config.hf_overrides import merge_hf_overrides
from loomserve.config.model import QUANTIZATIONS
from loomserve.execution.layers.fp8 import Fp8Linear, quantize_fp8_linears
from loomserve.execution.layers.mxfp4 import Mxfp4Experts
from loomserve.execution.layers.quant import QuantEmbedding, QuantLinear, quantize_linears
from loomserve.execution.models.arch_config import context_length, context_limit
from loomserve.execution.models.loading.checkpoint import (
    check_quantization_config,
    iter_safetensors,
    mxfp4_in_place,
)
from loomserve.execution.models.loading.default import DEFAULT_MODEL_NAME, default_model_path
from loomserve.execution.models.loading.gguf import cached_conversion
from loomserve.execution.models.loading.gguf_quant import quantize_from_gguf
from loomserve.execution.models.loading.hub import (
    hub_model_name,
    missing_path_message,
    parse_hub_id,
    resolve_hub_model,
)
from loomserve.execution.models.loading.weight_layout import optimize_cpu_layout
from loomserve.execution.models.registry import resolve
from loomserve.execution.parallel.state import get_tp
from loomserve.execution.parallel.tensor_parallel import (
    check_supported,
    parallelize,
    shard_config,
    shard_weights,
)


@dataclass
class LoadedModel:
    model: nn.Module  # implements the contract in loomserve.execution.models.registry
    config: Any  # the model class's config_class (registry.py), parsed from config.json
    name: str  # default: SmolLM2-135M-Instruct; folder: basename; gguf: file stem
    folder: str  # HF folder the weights were read from (the conversion cache for a gguf)
    layout: str = "default"  # the CPU weight layout chosen (loomserve.execution.models.loading.weight_layout)
    quantization: str = "none"  # none | gguf | int8 | int4 (layers/quant.py) | fp8 (layers/fp8.py)
    # | mxfp4 (an MXFP4 checkpoint's experts in place, the rest as none: layers/mxfp4.py)
    num_params: int = 0  # counted as loaded, before the layout; see count_weights
    weight_bytes: int = 0
    max_model_len: int = 0  # the context the rotary tables cover (arch_config.context_length)


def resolve_model(path: str | None, cache_dir: str, revision: str | None = None,
                  download_dir: str | None = None) -> tuple[str, str]:
    """(HF folder, model name) for a model argument, converting a GGUF on first use. A hub id
    (org/name[:QUANT], not a local path) is fetched into the hub cache first (hub.py)."""
    name = None
    if path is None:
        path, name = default_model_path(), DEFAULT_MODEL_NAME
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        if parse_hub_id(path) is None:
            raise FileNotFoundError(missing_path_message(path))
        path, name = resolve_hub_model(path, revision, download_dir), path
    name = name or hub_model_name(path)  # a hub snapshot is named by its repo id
    if os.path.isfile(path) and path.endswith(".gguf"):
        return cached_conversion(path, cache_dir), name or os.path.splitext(os.path.basename(path))[0]
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
        return path, name or os.path.basename(os.path.normpath(path))
    raise FileNotFoundError(f"model {path!r} is neither a .gguf file nor an HF folder with "
                            "config.json")


def resolve_config(path: str | None, cache_dir: str,
                   hf_overrides: dict | None = None) -> tuple[type, Any]:
    """(model class, parsed config) of a model argument, from its config.json alone (what the
    parallel checks need before any process starts; a GGUF is converted on first use), with
    --hf-overrides merged in."""
    folder, _ = resolve_model(path, cache_dir)
    return resolve(merge_hf_overrides(_read_config(folder), hf_overrides))


def _read_config(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def _trained_limit(hf_config: dict[str, Any]) -> int:
    """The context the checkpoint's own config covers, before --hf-overrides (a config that
    only the overrides make runnable: its max_position_embeddings)."""
    try:
        return context_limit(resolve(hf_config)[1])
    except (ValueError, KeyError):
        return int(hf_config.get("max_position_embeddings", 2048))


def resolve_quantization(requested: str, path: str | None, device: torch.device) -> str:
    """`auto` -> "gguf" for a GGUF model (the built-in one included: path None) on a CPU with
    one tensor-parallel rank, where its blocks run in place (the built-in model decodes 3.4x
    faster than dequantized to fp32); "none" anywhere else. Any other mode is kept."""
    if requested != "auto":
        return requested
    is_gguf = path is None or (os.path.isfile(path) and path.endswith(".gguf"))
    return "gguf" if is_gguf and device.type == "cpu" and get_tp() is None else "none"


def load_model(path: str | None, dtype: torch.dtype, device: torch.device | str,
               cache_dir: str, quantization: str = "none", hf_overrides: dict | None = None,
               max_model_len: int | None = None) -> LoadedModel:
    """quantization: "auto" (resolve_quantization), "none" (weights in `dtype`; an FP8
    checkpoint dequantized), "gguf" (a .gguf file's quantized blocks kept as they are),
    "int8" / "int4" (linears quantized at load; see layers/quant.py), "fp8" (e4m3 with per-row
    scales; layers/fp8.py). hf_overrides: merged into config.json (config/hf_overrides.py);
    max_model_len: the context to run (None: the config's; arch_config.context_length)."""
    device = torch.device(device)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, not {quantization!r}")
    gguf_path = os.path.expanduser(path) if path is not None else None
    requested, quantization = quantization, resolve_quantization(quantization, gguf_path, device)
    if quantization == "gguf":
        gguf_path = gguf_path or default_model_path()
        if not (os.path.isfile(gguf_path) and gguf_path.endswith(".gguf")):
            raise ValueError(f"quantization='gguf' needs a .gguf model file, not {path!r}; "
                             "use int8 or int4 for an HF folder")
    folder, name = resolve_model(path, cache_dir)
    own_config = _read_config(folder)
    hf_config = merge_hf_overrides(own_config, hf_overrides)
    fp8_block = check_quantization_config(hf_config)
    model_cls, cfg = resolve(hf_config)
    max_len = context_length(max_model_len, cfg,
                             _trained_limit(own_config) if hf_overrides else None)
    tp = get_tp()
    # the experts run as their MXFP4 blocks (checkpoint.py)
    keep_mxfp4 = mxfp4_in_place(hf_config, cfg, requested, 1 if tp is None else tp.size)
    if keep_mxfp4:
        cfg = replace(cfg, mxfp4_experts=True)
    weights = iter_safetensors(folder, fp8_block, keep_mxfp4)
    # Build on the meta device with the init functions off: no time spent initializing weights
    # that are overwritten next (and torch.nn.init under the meta device mode would import
    # torch._dynamo: ~3.4 s of every engine start on the 2-core test host).
    with torch.device("meta"), _no_weight_init():
        if tp is None:
            model = model_cls(cfg)
        else:  # one rank's slice of the model (loomserve.execution.parallel.tensor_parallel)
            check_supported(model_cls, cfg, tp.size, quantization)
            model = model_cls(shard_config(model_cls, cfg, tp))
            parallelize(model, cfg, tp)
            weights = shard_weights(model_cls, weights, cfg, tp)
    model = model.to(dtype).to_empty(device=device)
    model.load_weights(weights)
    if quantization == "gguf":
        quantize_from_gguf(model, gguf_path)
    elif quantization in ("int8", "int4"):
        quantize_linears(model, 8 if quantization == "int8" else 4)
    elif quantization == "fp8":
        quantize_fp8_linears(model)
    if quantization != "none":
        model.to(device)
    num_params, weight_bytes = count_weights(model)
    layout = optimize_cpu_layout(model, device, dtype, _tied_embedding(model))
    model.init_rotary(max_len, device, dtype)  # [max_len, head_dim] tables: not the limit's
    model.eval().requires_grad_(False)
    if keep_mxfp4 and quantization == "none":
        quantization = "mxfp4"  # what runs: the checkpoint's MXFP4 experts, in place
    return LoadedModel(model, cfg, name, folder, layout, quantization, num_params, weight_bytes,
                       max_len)


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
                   "orthogonal_")


@contextlib.contextmanager
def _no_weight_init():
    """torch.nn.init's in-place initializers return their tensor untouched (as transformers'
    no_init_weights does); restored on exit. For a build whose weights are all loaded next."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def count_weights(model: nn.Module) -> tuple[int, int]:
    """(parameters, weight bytes one decode step reads) of a model as the checkpoint filled it.

    Counted before optimize_cpu_layout, which re-lays bf16 linears into packed tensors that are
    no parameters (counted after it, a bf16 model lost every linear). Parameters: each distinct
    one once, a tied embedding once, as transformers' num_parameters() does. Bytes: what a decode
    step streams, every weight matrix once in the dtype it runs in (fp32 routers at 4 bytes; a
    tied embedding once, read whole as the LM head; the packed copies are the same size), except
    an untied input embedding, of which a step gathers only its tokens' rows. Every MoE expert
    counts, so with few streams, where a step reads only the routed ones, this is an upper bound.
    """
    params = list(model.parameters())
    num_params = sum(p.numel() for p in params)
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    for m in model.modules():  # quantized modules hold buffers: their packed bytes are the weights
        if isinstance(m, (QuantLinear, Fp8Linear)):
            num_params += m.out_features * m.in_features + (0 if m.bias is None else m.bias.numel())
            weight_bytes += m.weight_bytes()
        elif isinstance(m, Mxfp4Experts):  # packed MXFP4 experts: buffers too
            weights, packed = m.packed_counts()
            num_params, weight_bytes = num_params + weights, weight_bytes + packed
    get = getattr(model, "get_input_embeddings", None)
    if get is not None and _tied_embedding(model) is None:
        table = get()
        weight_bytes -= (table.weight_bytes() if isinstance(table, QuantEmbedding)
                         else table.weight.numel() * table.weight.element_size())
    return num_params, weight_bytes


def _tied_embedding(model: nn.Module) -> nn.Module | None:
    """The input embedding when the model reads its LM head from it (lm_head is None)."""
    if getattr(model, "lm_head", False) is not None:
        return None
    get = getattr(model, "get_input_embeddings", None)
    return get() if get is not None else None
