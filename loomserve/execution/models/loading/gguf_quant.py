"""GGUF quantized blocks -> loomserve's quantized formats (layers/quant.py), without dequantizing.

`from_gguf_blocks` turns one tensor's raw block bytes into a QuantWeight, every type in its own
format, nothing re-rounded:
  Q4_0  Q4, s=d, m=-8d, q = the block's nibbles as they are
  Q4_1  Q4, s=d, m=m
  Q5_0  Q5, q-16 (5 bits), s=d, no m
  Q5_1  Q5, s=d, m=m
  Q8_0  Q8, s=d, no m
  Q4_K, Q5_K, Q6_K   the K formats: d, dmin, the 6-bit (Q6_K: int8) sub-block scales and mins
        and q as the file stores them
Every one is exact: QuantWeight.dequantize equals gguf.quants.dequantize bit for bit. Other
types (F32, F16, BF16, Q2_K, Q3_K, IQ*, ...) are not converted: their layers stay float (read
from the dequantized HF folder).

`quantize_from_gguf` swaps a loaded model's linears (and the embedding) for quantized ones built
from the file's blocks: fused q|k|v and gate|up take their parts' rows stacked, or, where the
parts' types differ (Q4_K_M: Q6_K v beside Q4_K q and k), one module of row segments, each
in its own format; llama's Q/K rows get the same un-permutation the float conversion applies
(gguf.unpermute_rope_rows), and rows the model's own load_weights reorders (DeepSeek's MLA
rope rows: `deinterleaved`) the same order. gpt-oss's MXFP4 expert stacks stay MXFP4
(layers/mxfp4.py via Mxfp4GptOssExperts.from_gguf).
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import torch
from torch import nn

from loomserve.execution.layers.quant import (
    GROUP,
    Q4,
    Q4_K,
    Q5,
    Q5_K,
    Q6_K,
    Q8,
    SUPER,
    QuantEmbedding,
    QuantLinear,
    QuantWeight,
    set_module,
)
from loomserve.execution.models.gpt_oss import Mxfp4GptOssExperts
from loomserve.execution.models.loading.gguf import hf_config, hf_name, unpermute_rope_rows

log = logging.getLogger(__name__)

_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _f16(a: np.ndarray, n: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.float16).reshape(n, -1).copy())


def _u8(a: np.ndarray, n: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.uint8).reshape(n, -1))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32] values in GGUF order (low nibbles, then high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5 [blocks, 4] bytes (a little-endian uint32) -> [blocks, 32] fifth bits."""
    bits = np.ascontiguousarray(qh).view("<u4").reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
    return (bits & 1).astype(np.uint8)


def _k_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K [blocks, 128] bytes -> [blocks, 256] low 4 bits: per 64 values 32 bytes,
    the low nibbles the first 32 values, the high nibbles the next."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, SUPER)


def from_gguf_blocks(data: np.ndarray, qtype, n: int, k: int) -> QuantWeight | None:
    """The QuantWeight of a GGUF tensor of `n` rows of `k` values from its raw blocks, or None
    when the type is not one of the converted ones."""
    import gguf

    T = gguf.GGMLQuantizationType
    if qtype not in (T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K) or k % GROUP:
        return None
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    b = np.ascontiguousarray(data).view(np.uint8).reshape(-1, size)
    if qtype in (T.Q4_0, T.Q4_1):
        d = _f16(b[:, 0:2], n)
        m = -8 * d if qtype == T.Q4_0 else _f16(b[:, 2:4], n)
        off = 2 if qtype == T.Q4_0 else 4
        return QuantWeight(Q4, _u8(b[:, off:off + 16], n), d, m)
    if qtype == T.Q8_0:
        return QuantWeight(Q8, _u8(b[:, 2:34], n).view(torch.int8), _f16(b[:, 0:2], n))
    if qtype in (T.Q5_0, T.Q5_1):
        off = 2 if qtype == T.Q5_0 else 4
        v = (_nibbles(b[:, off + 4:off + 20]) | (_high_bits(b[:, off:off + 4]) << 4)).astype(np.int8)
        m = None if qtype == T.Q5_0 else _f16(b[:, 2:4], n)
        q = torch.from_numpy(v - np.int8(16) if m is None else v).reshape(n, k)
        return QuantWeight(Q5, q, _f16(b[:, 0:2], n), m)
    if qtype == T.Q6_K:  # ql[128] qh[64] scales[16] d: gguf-py's own unpacking of the values
        ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q = (ql & 0x0F).reshape(-1, SUPER) | ((qh & 0x03).reshape(-1, SUPER) << 4)
        return QuantWeight(Q6_K, _u8(q, n), _f16(b[:, 208:210], n),
                           sc=_u8(b[:, 192:208], n).view(torch.int8))
    # Q4_K: d dmin scales[12] qs[128]; Q5_K: d dmin scales[12] qh[32] qs[128]
    sc, mn = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])
    if qtype == T.Q4_K:
        q, fmt = _k_low(b[:, 16:144]), Q4_K
    else:
        high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        q, fmt = _k_low(b[:, 48:176]) | (high.reshape(-1, SUPER) << 4), Q5_K
    return QuantWeight(fmt, _u8(q, n), _f16(b[:, 0:2], n), _f16(b[:, 2:4], n), _u8(sc, n), _u8(mn, n))


def _permute(w: QuantWeight, heads: int) -> QuantWeight:
    order = unpermute_rope_rows(np.arange(w.shape[0]), heads)
    return w.rows(torch.from_numpy(np.ascontiguousarray(order)))


def quantize_from_gguf(model: nn.Module, path: str) -> dict:
    """Replace `model`'s linears and input embedding by quantized modules read from the GGUF
    file's blocks; returns {"quantized": modules converted, "float": linears kept float,
    "tensors": GGUF tensors run in place per type}."""
    import gguf

    reader = gguf.GGUFReader(path)
    cfg = hf_config(reader)
    arch = str(reader.fields["general.architecture"].contents())
    by_hf = {hf_name(t.name, arch): t for t in reader.tensors}
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    permute = cfg["model_type"] == "llama"
    kept: Counter = Counter()

    def part(hf: str) -> tuple[QuantWeight, str] | None:
        t = by_hf.get(f"{hf}.weight")
        if t is None:
            return None
        k, n = (int(x) for x in t.shape[:2])  # GGUF lists dims fastest-first
        got = from_gguf_blocks(t.data, t.tensor_type, n, k)
        if got is None:
            return None
        short = hf.rsplit(".", 1)[-1]
        if permute and short in heads:
            got = _permute(got, heads[short])
        order = _model_row_order(model, hf, got.shape[0])
        return (got if order is None else got.rows(order)), t.tensor_type.name

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
        weights = [w for w, _ in parts]
        if sum(w.shape[0] for w in weights) != mod.out_features or weights[0].shape[1] != mod.in_features:
            raise ValueError(f"GGUF tensors for {name} have {[w.shape for w in weights]}, model wants "
                             f"{(mod.out_features, mod.in_features)}")
        set_module(model, name, QuantLinear.of(weights, mod.bias, dtype))
        kept.update(kind for _, kind in parts)
        counts["quantized"] += 1
    emb = model.get_input_embeddings()
    emb_name = next(n for n, mod in model.named_modules() if mod is emb)
    got = part(emb_name)
    if got is not None:
        set_module(model, emb_name, QuantEmbedding.of(got[0], dtype=dtype))
        kept[got[1]] += 1
        counts["quantized"] += 1
    experts = _mxfp4_experts(model, reader) if arch == "gpt-oss" else 0
    if experts:
        kept["MXFP4"] += 3 * experts
        counts["quantized"] += experts
    counts["tensors"] = dict(kept)
    log.info("GGUF blocks run in place: %s (%d modules); %d linears stay float",
             ", ".join(f"{n} {kind}" for kind, n in sorted(kept.items())) or "none",
             counts["quantized"], counts["float"])
    return counts


def _model_row_order(model: nn.Module, hf: str, rows: int) -> torch.Tensor | None:
    """The row order the model's load_weights gives the checkpoint weight `hf` (DeepSeek's MLA
    rope rows, pair-interleaved in the checkpoint), or None where it keeps the stored order."""
    fix = getattr(model, "deinterleaved", None)
    prefix, _, rest = hf.partition(".layers.")
    if fix is None or not rest:
        return None
    order = fix(f"{rest.partition('.')[2]}.weight", torch.arange(rows))
    return None if torch.equal(order, torch.arange(rows)) else order


def _mxfp4_experts(model: nn.Module, reader) -> int:
    """gpt-oss layers whose three expert stacks are MXFP4 get them packed as stored (the float
    copies the conversion loaded are dropped); returns the layers converted."""
    import gguf

    by_name = {t.name: t for t in reader.tensors}
    done = 0
    for i, layer in enumerate(model.model.layers):
        stacks = [by_name.get(f"blk.{i}.ffn_{p}_exps.weight") for p in ("gate", "up", "down")]
        if any(t is None or t.tensor_type != gguf.GGMLQuantizationType.MXFP4 for t in stacks):
            continue
        layer.mlp.experts = Mxfp4GptOssExperts.from_gguf(model.config, layer.mlp.experts,
                                                         *(t.data for t in stacks))
        done += 1
    return done
