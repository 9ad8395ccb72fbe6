"""GGUF quantized blocks -> loomserve's quantized format (layers/quant.py), without dequantizing.

`from_gguf_blocks` turns one tensor's raw block bytes into (q, scales, mins, bits):
  Q4_0  s=d, m=-8d, q = the block's nibbles as they are           (exact)
  Q4_1  s=d, m=m                                                 (exact)
  Q8_0  8-bit, s=d, no mins                                       (exact)
  Q5_0  8-bit, q-16, s=d, no mins                                 (exact)
  Q5_1  8-bit, s=d, m=m                                           (exact)
  Q4_K  per 32-sub-block s=d*sc, m=-dmin*mn, rounded to fp16      (relative 2^-11)
"Exact": dequantize(...) equals gguf.quants.dequantize bit for bit. Other types (F32, F16, Q6_K,
...) are not converted: their layers stay float (read from the dequantized HF folder).

`quantize_from_gguf` swaps a loaded model's linears (and the embedding) for quantized ones built
from the file's blocks: fused q|k|v and gate|up take their parts' rows stacked; llama's Q/K
rows get the same un-permutation the float conversion applies (gguf.unpermute_rope_rows).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from loomserve.execution.layers.quant import (
    GROUP,
    QuantEmbedding,
    QuantLinear,
    pack_int4,
    set_module,
    unpack_int4,
)
from loomserve.execution.models.loading.gguf import hf_config, hf_name, unpermute_rope_rows

log = logging.getLogger(__name__)

_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _f16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.float16).reshape(-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32] values in GGUF order (low nibbles, then high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5 [blocks, 4] bytes (a little-endian uint32) -> [blocks, 32] fifth bits."""
    bits = np.ascontiguousarray(qh).view("<u4").reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
    return (bits & 1).astype(np.uint8)


def from_gguf_blocks(data: np.ndarray, qtype, n: int, k: int):
    """(q, scales, mins, bits) for a GGUF tensor of `n` rows of `k` values from its raw blocks,
    or None when the type is not one of the converted ones."""
    import gguf

    T = gguf.GGMLQuantizationType
    if qtype not in (T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1, T.Q4_K) or k % GROUP:
        return None
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    b = np.ascontiguousarray(data).view(np.uint8).reshape(-1, size)
    mins = None
    if qtype in (T.Q4_0, T.Q4_1):
        off = 2 if qtype == T.Q4_0 else 4
        d = _f16(b[:, 0:2])
        mins = -8 * d if qtype == T.Q4_0 else _f16(b[:, 2:4])
        q, bits, scales = torch.from_numpy(b[:, off:off + 16].reshape(n, k // 2).copy()), 4, d
    elif qtype == T.Q8_0:
        scales, bits = _f16(b[:, 0:2]), 8
        q = torch.from_numpy(b[:, 2:34].view(np.int8).reshape(n, k).copy())
    elif qtype in (T.Q5_0, T.Q5_1):
        off = 2 if qtype == T.Q5_0 else 4
        scales, bits = _f16(b[:, 0:2]), 8
        v = (_nibbles(b[:, off + 4:off + 20]) | (_high_bits(b[:, off:off + 4]) << 4)).astype(np.int8)
        if qtype == T.Q5_0:
            v = v - np.int8(16)
        else:
            mins = _f16(b[:, 2:4])
        q = torch.from_numpy(v.reshape(n, k))
    else:  # Q4_K: 256-value super-blocks of 8 sub-blocks of 32
        d, dmin = _f16(b[:, 0:2]).astype(np.float32), _f16(b[:, 2:4]).astype(np.float32)
        sc, mn = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])
        scales = (d[:, None] * sc.astype(np.float32)).astype(np.float16).reshape(-1)
        mins = (-(dmin[:, None] * mn.astype(np.float32))).astype(np.float16).reshape(-1)
        qs = b[:, 16:144].reshape(-1, 4, 1, 32)  # per 64 values: 32 bytes, low then high nibbles
        v = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, k)
        q, bits = pack_int4(torch.from_numpy(v)), 4
    s = torch.from_numpy(np.ascontiguousarray(scales).reshape(n, k // GROUP))
    m = None if mins is None else torch.from_numpy(np.ascontiguousarray(mins).reshape(n, k // GROUP))
    return q, s, m, bits


def _merge(parts):
    """Stack quantized parts' rows; int4 parts join int8 ones as bytes, missing mins become 0."""
    bits = max(p[3] for p in parts)
    has_mins = any(p[2] is not None for p in parts)
    qs, ss, ms = [], [], []
    for q, s, m, b in parts:
        qs.append(unpack_int4(q).to(torch.int8) if b < bits else q)
        ss.append(s)
        ms.append(m if m is not None or not has_mins else torch.zeros_like(s))
    return torch.cat(qs), torch.cat(ss), torch.cat(ms) if has_mins else None, bits


def _permute(part, heads: int):
    q, s, m, bits = part
    rows = lambda t: None if t is None else torch.from_numpy(  # noqa: E731
        np.ascontiguousarray(unpermute_rope_rows(t.numpy(), heads)))
    return rows(q), rows(s), rows(m), bits


def quantize_from_gguf(model: nn.Module, path: str) -> dict[str, int]:
    """Replace `model`'s linears and input embedding by quantized modules read from the GGUF
    file's blocks; returns {"quantized": modules converted, "float": linears kept float}."""
    import gguf

    reader = gguf.GGUFReader(path)
    cfg = hf_config(reader)
    by_hf = {hf_name(t.name): t for t in reader.tensors}
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    permute = cfg["model_type"] == "llama"

    def part(hf: str):
        t = by_hf.get(f"{hf}.weight")
        if t is None:
            return None
        k, n = (int(x) for x in t.shape[:2])  # GGUF lists dims fastest-first
        got = from_gguf_blocks(t.data, t.tensor_type, n, k)
        short = hf.rsplit(".", 1)[-1]
        return _permute(got, heads[short]) if got is not None and permute and short in heads else got

    counts = {"quantized": 0, "float": 0}
    dtype = next(model.parameters()).dtype
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        prefix, _, leaf = name.rpartition(".")
        names = [f"{prefix}.{p}" for p in _FUSED_PARTS[leaf]] if leaf in _FUSED_PARTS else [name]
        parts = [part(hf) for hf in names]
        if any(p is None for p in parts):
            counts["float"] += 1
            continue
        q, s, m, bits = _merge(parts)
        if tuple(s.shape) != (mod.out_features, mod.in_features // GROUP):
            raise ValueError(f"GGUF tensors for {name} have {tuple(s.shape)} groups, model wants "
                             f"{(mod.out_features, mod.in_features // GROUP)}")
        set_module(model, name, QuantLinear(q, s, m, bits, mod.bias, dtype))
        counts["quantized"] += 1
    emb = model.get_input_embeddings()
    emb_name = next(n for n, mod in model.named_modules() if mod is emb)
    got = part(emb_name)
    if got is not None:
        set_module(model, emb_name, QuantEmbedding(*got, dtype=dtype))
        counts["quantized"] += 1
    log.info("GGUF blocks kept quantized: %d modules; %d linears stay float", counts["quantized"],
             counts["float"])
    return counts
