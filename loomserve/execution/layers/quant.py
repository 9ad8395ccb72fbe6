"""Quantized linear layers and embeddings: 4-bit / 8-bit weights that stay quantized in memory.

One format for every source (HF checkpoints quantized here, GGUF blocks read as they are):
a weight [N, K] in groups of G=32 along K, value w[n, k] = s[n, g] * q[n, k] + m[n, g].
- bits=4: q in 0..15, packed two per byte in GGUF's Q4_0 nibble order (per group, byte j holds
  q[j] in its low and q[j+16] in its high nibble): uint8 [N, K/2].
- bits=8: q int8 [N, K].
- s, m: fp16 [N, K/32]; m is None for symmetric formats (Q8_0, int8).
GGUF Q4_0 (s=d, m=-8d), Q4_1 (s=d, m=m), Q8_0 (s=d), Q5_0/Q5_1 (as int8) map onto it exactly;
Q4_K (s=d*sc, m=-dmin*mn) up to rounding s and m to fp16 (relative 2^-11).

Row slicing and concatenation keep the format (groups run along K), so fused q|k|v and gate|up
projections are the parts' rows stacked, and llama.cpp's Q/K row permutation is a row gather.

On CPU the product runs in kernels/quant.c (x quantized per 32-block to int8, integer dot
products, never a float copy of W), which reads the weights tiled (tile_weight: 8 rows
interleaved per group, the file's docstring has the layout); a module built where the kernel
loads keeps only that tiled copy (`parts()` recovers q, s, m). Elsewhere, or with the kernels
off, a torch fallback dequantizes W per call.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution import kernels

GROUP = 32
_lib_cache: list = []


def _lib():
    """The quant kernel library with argtypes set, or None (then the torch path runs)."""
    if not _lib_cache:
        lib = kernels.load("quant")
        if lib is not None:
            p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
            lib.quant_matmul.argtypes = [p, i64, i64, p, i32, i64, i32, p, p, i32]
            lib.quant_matmul.restype = None
            lib.quant_gather.argtypes = [p, i32, i32, i64, p, i64, p, i32]
            lib.quant_gather.restype = None
        _lib_cache.append(lib)
    return _lib_cache[0]


# --- the format ---------------------------------------------------------------------------------

def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] with values 0..15 -> uint8 [N, K/2] in Q4_0 nibble order."""
    n, k = q.shape
    g = q.to(torch.uint8).reshape(n, k // GROUP, 2, GROUP // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4."""
    n, half = p.shape
    g = p.reshape(n, half // (GROUP // 2), 1, GROUP // 2)
    return torch.cat([g & 0x0F, g >> 4], dim=2).reshape(n, half * 2)


def dequantize(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] the format represents (computed in fp32: s*q, then + m)."""
    qf = (unpack_int4(q) if bits == 4 else q).to(torch.float32)
    n, k = qf.shape
    w = qf.view(n, k // GROUP, GROUP) * scales.to(torch.float32).unsqueeze(-1)
    if mins is not None:
        w = w + mins.to(torch.float32).unsqueeze(-1)
    return w.reshape(n, k).to(dtype)


TILE_ROWS = 8  # weight rows per kernel tile (kernels/quant.c: R)


def _rows_to_tiles(v: torch.Tensor, tiles: int) -> torch.Tensor:
    """[T*8, nb] of 2-byte values -> uint8 [T, nb, 16]: each group's 8 rows side by side."""
    nb = v.shape[1]
    return v.contiguous().view(tiles, TILE_ROWS, nb).permute(0, 2, 1).contiguous() \
        .view(torch.uint8).view(tiles, nb, 16)


def tile_weight(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                bits: int) -> torch.Tensor:
    """(q, s, m) -> the kernel's layout, uint8 [ceil(N/8), K/32, block]: per tile of 8 rows and
    group, q as 4-byte chunks of the 8 rows interleaved, s, [int8: sum of q], [m]. Rows past N
    are zeros (they add nothing; their outputs are never stored)."""
    n, nb = scales.shape
    tiles = -(-n // TILE_ROWS)
    pad = tiles * TILE_ROWS - n
    qu = q.contiguous().view(torch.uint8)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t

    chunks = 4 if bits == 4 else 8
    parts = [padded(qu).view(tiles, TILE_ROWS, nb, chunks, 4).permute(0, 2, 3, 1, 4)
             .reshape(tiles, nb, chunks * 32),
             _rows_to_tiles(padded(scales.to(torch.float16)), tiles)]
    if bits == 8:  # the VNNI path feeds x in as xq + 128 and takes 128 * sum(q) back off
        wsum = qu.view(torch.int8).view(n, nb, GROUP).sum(-1, dtype=torch.int32)
        parts.append(_rows_to_tiles(padded(wsum.to(torch.int16)), tiles))
    if mins is not None:
        parts.append(_rows_to_tiles(padded(mins.to(torch.float16)), tiles))
    return torch.cat(parts, -1).contiguous()


def untile_weight(tiled: torch.Tensor, n: int, bits: int, has_mins: bool):
    """Inverse of tile_weight: (q, scales, mins) of the first n rows."""
    tiles, nb, _ = tiled.shape
    qb = 128 if bits == 4 else 256

    def rows(off: int, dtype: torch.dtype) -> torch.Tensor:
        v = tiled[..., off:off + 16].contiguous().view(dtype).view(tiles, nb, TILE_ROWS)
        return v.permute(0, 2, 1).reshape(tiles * TILE_ROWS, nb)[:n].contiguous()

    q = tiled[..., :qb].reshape(tiles, nb, qb // 32, TILE_ROWS, 4).permute(0, 3, 1, 2, 4) \
        .reshape(tiles * TILE_ROWS, nb * qb // TILE_ROWS)[:n].contiguous()
    mins = rows(qb + (32 if bits == 8 else 16), torch.float16) if has_mins else None
    return (q.view(torch.int8) if bits == 8 else q), rows(qb, torch.float16), mins


def quantize_weight(w: torch.Tensor, bits: int, group: int = GROUP):
    """A float weight [N, K] -> (q, scales, mins): int8 symmetric (s = max|w|/127, no mins) or
    int4 asymmetric (s = (max-min)/15, m = min) per group; s and m are rounded to fp16 first, so
    q is the nearest level of the scale actually stored."""
    if group != GROUP:
        raise ValueError(f"only group={GROUP} is supported")
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"in_features {k} is not a multiple of {GROUP}")
    g = w.detach().to(torch.float32).reshape(n, k // GROUP, GROUP)
    if bits == 8:
        s = (g.abs().amax(-1) / 127).to(torch.float16)
        inv = torch.where(s > 0, 1 / s.float(), torch.zeros((), dtype=torch.float32))
        q = torch.round(g * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return q.reshape(n, k).contiguous(), s.contiguous(), None
    if bits == 4:
        lo, hi = g.amin(-1), g.amax(-1)
        s, m = ((hi - lo) / 15).to(torch.float16), lo.to(torch.float16)
        inv = torch.where(s > 0, 1 / s.float(), torch.zeros((), dtype=torch.float32))
        q = torch.round((g - m.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(0, 15)
        return pack_int4(q.reshape(n, k).to(torch.uint8)), s.contiguous(), m.contiguous()
    raise ValueError(f"bits must be 4 or 8, not {bits}")


# --- modules ------------------------------------------------------------------------------------

class QuantLinear(nn.Module):
    """A frozen linear layer over a quantized weight (see the module docstring)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
                 bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, not {bits}")
        self.bits = bits
        self.out_features, groups = scales.shape
        self.in_features = groups * GROUP
        self.dtype = dtype  # the activations' dtype: outputs are cast back to it
        want = (self.out_features, self.in_features // 2 if bits == 4 else self.in_features)
        if tuple(q.shape) != want:
            raise ValueError(f"q shape {tuple(q.shape)} != {want} for {bits}-bit scales {tuple(scales.shape)}")
        self.has_mins = mins is not None
        bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.register_buffer("bias", bias)
        scales = scales.to(torch.float16)
        mins = None if mins is None else mins.to(torch.float16)
        if q.device.type == "cpu" and _lib() is not None:  # the kernel's layout, the only copy kept
            self.register_buffer("tiled", tile_weight(q, scales, mins, bits))
            q = scales = mins = None
        else:
            self.register_buffer("tiled", None)
        self.register_buffer("q", None if q is None else q.contiguous())
        self.register_buffer("scales", None if scales is None else scales.contiguous())
        self.register_buffer("mins", None if mins is None else mins.contiguous())
        self._ptrs: tuple | None = None

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q, scales, mins) in the rows format, whichever copy the module keeps."""
        if self.tiled is None:
            return self.q, self.scales, self.mins
        return untile_weight(self.tiled, self.out_features, self.bits, self.has_mins)

    @classmethod
    def from_float(cls, linear: nn.Linear, bits: int) -> "QuantLinear":
        q, s, m = quantize_weight(linear.weight, bits)
        return cls(q, s, m, bits, linear.bias, linear.weight.dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(*self.parts(), self.bits, dtype)

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = _lib() if x.device.type == "cpu" and self.tiled is not None else None
        if lib is not None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            return self._kernel(lib, x)  # the decode path: no reshapes or casts to pay for
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if lib is None:
            y = F.linear(x2.to(torch.float32), self.dequantized(), self.bias)
        else:
            y = self._kernel(lib, x2.to(torch.float32).contiguous())
        return y.to(x.dtype).view(*lead, self.out_features)

    def _kernel(self, lib, xf: torch.Tensor) -> torch.Tensor:
        """xf: contiguous fp32 [M, K] -> fp32 [M, N]."""
        y = torch.empty(xf.shape[0], self.out_features, dtype=torch.float32)
        if xf.shape[0] == 0:
            return y
        if self._ptrs is None:  # ints: ctypes passes them fastest (~100 such calls per step)
            self._ptrs = (self.tiled.data_ptr(), None if self.bias is None else self.bias.data_ptr())
        w, b = self._ptrs
        lib.quant_matmul(xf.data_ptr(), xf.shape[0], self.in_features, w, self.has_mins,
                         self.out_features, self.bits, b, y.data_ptr(), torch.get_num_threads())
        return y

    def _apply(self, fn, *args, **kwargs):
        self._ptrs = None  # .to() / .share_memory_() may move the buffers
        out = super()._apply(fn, *args, **kwargs)
        if self.tiled is not None and self.tiled.device.type != "cpu":  # off the kernel's device:
            self.q, self.scales, self.mins = self.parts()  # rows, for the fallback's dequantize
            self.tiled = None
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group={GROUP}, mins={self.mins is not None}, bias={self.bias is not None}")


class QuantEmbedding(QuantLinear):
    """An embedding table in the quantized format: forward gathers rows (dequantized to the
    model dtype); `project` multiplies by the table, for a tied LM head."""

    def __init__(self, q, scales, mins, bits, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(q, scales, mins, bits, None, dtype)
        self.num_embeddings, self.embedding_dim = self.out_features, self.in_features

    @classmethod
    def from_float(cls, embedding: nn.Embedding, bits: int) -> "QuantEmbedding":
        q, s, m = quantize_weight(embedding.weight, bits)
        return cls(q, s, m, bits, embedding.weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        lib = _lib() if self.tiled is not None and self.tiled.device.type == "cpu" else None
        if lib is None:
            q, s, m = self.parts()
            rows = dequantize(q[flat], s[flat], None if m is None else m[flat], self.bits)
        else:
            rows = torch.empty(flat.numel(), self.in_features, dtype=torch.float32)
            ptr = kernels.ptr
            lib.quant_gather(ptr(self.tiled), self.has_mins, self.bits, self.in_features, ptr(flat),
                             flat.numel(), ptr(rows), torch.get_num_threads())
        return rows.to(self.dtype).view(*ids.shape, self.in_features)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return QuantLinear.forward(self, hidden).to(hidden.dtype)


# Routers pick experts; a rounding flip there changes which weights run, so they stay float.
_KEEP_FLOAT = ("router", "gate", "shared_expert_gate")
HEAD_BITS = 8  # the LM head (and a tied embedding) in int4 mode too, as llama.cpp keeps it >= 6-bit


def quantize_linears(model: nn.Module, bits: int) -> dict[str, int]:
    """Replace every nn.Linear of `model` (in_features a multiple of 32, not a router) by a
    QuantLinear of `bits`; the LM head and a tied embedding get HEAD_BITS. Returns counts."""
    counts = {"quantized": 0, "float": 0}
    tied = getattr(model, "lm_head", False) is None
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        leaf = name.rpartition(".")[2]
        if leaf in _KEEP_FLOAT or mod.in_features % GROUP:
            counts["float"] += 1
            continue
        set_module(model, name, QuantLinear.from_float(mod, HEAD_BITS if leaf == "lm_head" else bits))
        counts["quantized"] += 1
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if get is not None else None
    if tied and isinstance(emb, nn.Embedding) and emb.embedding_dim % GROUP == 0:
        name = next(n for n, m in model.named_modules() if m is emb)
        set_module(model, name, QuantEmbedding.from_float(emb, HEAD_BITS))
        counts["quantized"] += 1
    return counts


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
