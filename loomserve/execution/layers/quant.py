"""Quantized linear layers and embeddings: weights that stay quantized in memory.

Formats (`fmt`: the codes kernels/quant.c takes; a QuantWeight holds one weight [N, K] in its
rows form, the form tile() lays out for the kernel):
- Q4, Q5, Q8 (4, 5, 8): groups of G=32 along K, w[n, k] = s[n, g] * q[n, k] + m[n, g];
  s, m fp16 [N, K/32], m None for symmetric formats. q: Q4 0..15 packed two per byte in GGUF's
  Q4_0 nibble order (per group, byte j holds q[j] in its low and q[j+16] in its high nibble):
  uint8 [N, K/2]; Q5 int8 [N, K] in -16..15 (no m) or 0..31 (with m), kept in 5 bits; Q8 int8.
  GGUF Q4_0 (s=d, m=-8d), Q4_1, Q5_0, Q5_1 and Q8_0 map onto them exactly, and the int4 / int8
  modes quantize HF weights into Q4 (with m) / Q8.
- Q4_K, Q5_K, Q6_K (14, 15, 16): GGUF's K-quants as the file stores them, nothing re-rounded:
  super-blocks of 256 along K with d (and dmin) fp16 [N, K/256]. Q4_K / Q5_K: sc, mn uint8
  [N, K/32] (6-bit), q uint8 [N, K] in 0..15 / 0..31, w = d*sc * q - dmin*mn; Q6_K: sc int8
  [N, K/16], q uint8 [N, K] in 0..63, w = d*sc * (q - 32). d*sc is exact in fp32, so
  QuantWeight.dequantize (fp32, in gguf-py's order) equals gguf.quants.dequantize bit for bit.
Tiled bytes per weight (kernels/quant.c's docstring has the layouts): Q4 with m 4.5 (4.0 + s),
Q5 5.5 / 6.0, Q8 9.0 (its VNNI offsets), Q4_K 4.625, Q5_K 5.625, Q6_K 6.5625.

Row slicing and concatenation keep a format (its blocks run along K), so fused q|k|v and gate|up
projections are their parts' rows stacked, and llama.cpp's Q/K row permutation is a row gather.
Parts of different formats (Q4_K_M puts v, or some ffn_down, in Q6_K beside Q4_K q and k) stay
row segments of one module, each in its own format: kernels/quant.c runs the segments in one call.

On CPU the product runs in kernels/quant.c (x quantized per 32-block to int8, integer dot
products, never a float copy of W), which reads the weights tiled: a module keeps only that
tiled copy (`tiled`; `quant_weights()` recovers the rows form). Without the kernel (no C
compiler, LOOMSERVE_KERNELS=0) a torch path dequantizes W per call from the same bytes. Off the
CPU (CUDA) the module unpacks once, when it is built or moved there, into a float copy in the
model dtype (`dense`): no forward dequantizes anything.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution import kernels

GROUP = 32
SUPER = 256  # K-quant super-block
Q4, Q5, Q8 = 4, 5, 8
Q4_K, Q5_K, Q6_K = 14, 15, 16
MULTI, MAX_SEGMENTS = 1, 8  # row segments of different formats (kernels/quant.c: MAX_SEGS)
K_FORMATS = (Q4_K, Q5_K, Q6_K)
FORMAT_NAMES = {Q4: "q4", Q5: "q5", Q8: "q8", Q4_K: "q4_k", Q5_K: "q5_k", Q6_K: "q6_k"}
_BITS = {Q4: 4, Q5: 5, Q8: 8, Q4_K: 4, Q5_K: 5, Q6_K: 6}
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


# --- the legacy formats -------------------------------------------------------------------------

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
    """The float weight [N, K] a legacy format represents (fp32: s*q, then + m)."""
    qf = (unpack_int4(q) if bits == 4 else q).to(torch.float32)
    n, k = qf.shape
    w = qf.view(n, k // GROUP, GROUP) * scales.to(torch.float32).unsqueeze(-1)
    if mins is not None:
        w = w + mins.to(torch.float32).unsqueeze(-1)
    return w.reshape(n, k).to(dtype)


TILE_ROWS = 8  # weight rows per kernel tile (kernels/quant.c: R)


def _interleave(v: torch.Tensor) -> torch.Tensor:
    """uint8 [T*8, B, S, w] (per row and block, S pieces of w bytes) -> [T, B, S*8*w]: per block,
    piece-major, each piece the 8 rows' bytes side by side (the kernel's chunk planes)."""
    n, b, s, w = v.shape
    return v.reshape(n // TILE_ROWS, TILE_ROWS, b, s, w).permute(0, 2, 3, 1, 4) \
        .reshape(n // TILE_ROWS, b, s * TILE_ROWS * w)


def _deinterleave(t: torch.Tensor, s: int, w: int) -> torch.Tensor:
    """Inverse of _interleave on a [T, B, S*8*w] slice: uint8 [T*8, B, S, w]."""
    tiles, b, _ = t.shape
    return t.reshape(tiles, b, s, TILE_ROWS, w).permute(0, 3, 1, 2, 4).reshape(tiles * TILE_ROWS, b, s, w)


def _bytes(t: torch.Tensor, blocks: int, per: int) -> torch.Tensor:
    """A per-row tensor (any dtype) as uint8 [N, blocks, S, per] (S from the size)."""
    u = t.contiguous().view(torch.uint8)
    return u.reshape(t.shape[0], blocks, -1, per)


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


# The bit planes are built and read in uint8 (their bits are distinct, so a uint8 sum is an OR):
# no wider temporary than the values themselves while a large table loads.

def _q5_shift(device) -> torch.Tensor:
    """Shifts [half, c, 1] of the 5th bit of value 16*half + 4c + b in the word's byte b."""
    return (torch.arange(2, device=device).view(2, 1, 1) * 4
            + torch.arange(4, device=device).view(1, 4, 1)).to(torch.uint8)


def _q5_plane(h: torch.Tensor) -> torch.Tensor:
    """5th bits uint8 [N, G, 32] (0/1) -> the q5 plane's words, uint8 [N, G, 1, 4]: byte b holds
    h[4c+b] in bit c and h[16+4c+b] in bit 4+c."""
    n, g, _ = h.shape
    return (h.view(n, g, 2, 4, 4) << _q5_shift(h.device)).sum((2, 3), dtype=torch.uint8).view(n, g, 1, 4)


def _q5_bits(plane: torch.Tensor) -> torch.Tensor:
    """Inverse of _q5_plane: uint8 [N, G, 1, 4] -> [N, G, 32]."""
    n, g = plane.shape[:2]
    return ((plane.view(n, g, 1, 1, 4) >> _q5_shift(plane.device)) & 1).view(n, g, 32)


def _q6_shift(device) -> torch.Tensor:
    """Shifts [half, 1, c1, 1] of the top bits of value 16*half + 8k + 4*c1 + b in H_k's byte b."""
    return (torch.arange(2, device=device).view(2, 1, 1, 1) * 4
            + torch.arange(2, device=device).view(1, 1, 2, 1) * 2).to(torch.uint8)


def _q6_plane(h: torch.Tensor) -> torch.Tensor:
    """Top 2 bits uint8 [N, G, 32] (0..3) -> the q6 planes H0, H1: uint8 [N, G, 2, 4]."""
    n, g, _ = h.shape
    return (h.view(n, g, 2, 2, 2, 4) << _q6_shift(h.device)).sum((2, 4), dtype=torch.uint8)


def _q6_bits(plane: torch.Tensor) -> torch.Tensor:
    """Inverse of _q6_plane: uint8 [N, G, 2, 4] -> [N, G, 32]."""
    n, g = plane.shape[:2]
    return ((plane.view(n, g, 1, 2, 1, 4) >> _q6_shift(plane.device)) & 3).view(n, g, 32)


def _nibble_plane(q: torch.Tensor) -> torch.Tensor:
    """Values uint8 [N, K] (low 4 bits used) -> uint8 [N, K/32, 4, 4]: Q4_0-packed, 4-byte chunks."""
    n, k = q.shape
    return pack_int4(q & 0x0F).view(n, k // GROUP, 4, 4)


def tile_weight(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                bits: int) -> torch.Tensor:
    """A legacy format's (q, s, m) -> the kernel's layout, uint8 [ceil(N/8), K/32, block]: per
    tile of 8 rows and group, q as 4-byte chunks of the 8 rows interleaved ([Q5: the q5 plane]),
    s, [int8: sum of q], [m]. Rows past N are zeros (they add nothing; their outputs are never
    stored)."""
    n, nb = scales.shape
    rows = -(-n // TILE_ROWS) * TILE_ROWS
    if bits == 5:  # stored unsigned: Q5_0's q + 16
        u = q.to(torch.uint8) + (16 if mins is None else 0)  # mod 256: -16..15 -> 0..31
        planes = torch.cat([_nibble_plane(u), _q5_plane((u >> 4).view(n, nb, GROUP))], 2)
    else:  # the packed nibbles or the int8 values, as they are
        planes = _bytes(q, nb, 4)
    parts = [planes, _bytes(scales.to(torch.float16), nb, 2)]
    if bits == 8:  # the VNNI path feeds x in as xq + 128 and takes 128 * sum(q) back off
        wsum = q.view(torch.int8).view(n, nb, GROUP).sum(-1, dtype=torch.int32)
        parts.append(_bytes(wsum.to(torch.int16), nb, 2))
    if mins is not None:
        parts.append(_bytes(mins.to(torch.float16), nb, 2))
    return torch.cat([_interleave(_padded(p, rows)).contiguous() for p in parts], -1).contiguous()


def untile_weight(tiled: torch.Tensor, n: int, bits: int, has_mins: bool):
    """Inverse of tile_weight: (q, scales, mins) of the first n rows."""
    qb = {4: 128, 5: 160, 8: 256}[bits]

    def half(off: int, dtype: torch.dtype) -> torch.Tensor:
        v = _deinterleave(tiled[..., off:off + 16], 1, 2)[:n]
        return v.contiguous().view(dtype).view(n, -1)

    if bits == 5:
        nib = _deinterleave(tiled[..., :128], 4, 4)[:n]
        v = unpack_int4(nib.reshape(n, -1)).view(n, -1, GROUP) | (_q5_bits(_deinterleave(tiled[..., 128:160], 1, 4)[:n]) << 4)
        q = (v - (0 if has_mins else 16)).to(torch.int8).view(n, -1)  # mod 256, as tile_weight
    else:
        q = _deinterleave(tiled[..., :qb], qb // 32, 4)[:n].reshape(n, -1).contiguous()
        q = q.view(torch.int8) if bits == 8 else q
    mins = half(qb + (32 if bits == 8 else 16), torch.float16) if has_mins else None
    return q, half(qb, torch.float16), mins


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


# --- any format ---------------------------------------------------------------------------------

@dataclasses.dataclass
class QuantWeight:
    """One weight [N, K] in one format's rows form (the module docstring lists the fields)."""

    fmt: int
    q: torch.Tensor
    scales: torch.Tensor  # legacy: s [N, K/32]; K-quants: d [N, K/256]
    mins: torch.Tensor | None = None  # legacy: m [N, K/32]; Q4_K / Q5_K: dmin [N, K/256]
    sc: torch.Tensor | None = None  # K-quants: sub-block scales
    mn: torch.Tensor | None = None  # Q4_K / Q5_K: sub-block mins

    def __post_init__(self) -> None:
        if self.fmt not in FORMAT_NAMES:
            raise ValueError(f"unknown quantized format {self.fmt}")
        n, k = self.shape
        want = {Q4: (n, k // 2)}.get(self.fmt, (n, k))
        if tuple(self.q.shape) != want:
            raise ValueError(f"q shape {tuple(self.q.shape)} != {want} for {FORMAT_NAMES[self.fmt]} "
                             f"scales {tuple(self.scales.shape)}")
        k_mins = self.fmt in (Q4_K, Q5_K)
        if (self.fmt in K_FORMATS) != (self.sc is not None) or k_mins != (self.mn is not None) \
                or (k_mins and self.mins is None) or (self.fmt == Q6_K and self.mins is not None):
            raise ValueError(f"{FORMAT_NAMES[self.fmt]}: wrong fields")

    @property
    def shape(self) -> tuple[int, int]:
        n, blocks = self.scales.shape
        return n, blocks * (SUPER if self.fmt in K_FORMATS else GROUP)

    @property
    def has_mins(self) -> bool:
        return self.mins is not None

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def rows(self, index) -> "QuantWeight":
        """The rows `index` (a slice or index tensor) of every field."""
        return dataclasses.replace(self, **{k: v[index] for k, v in self._tensors().items()})

    @staticmethod
    def cat(parts: Sequence["QuantWeight"]) -> "QuantWeight":
        """Rows stacked; the parts share a format and (legacy) the presence of m."""
        first = parts[0]
        if any(p.fmt != first.fmt or p.has_mins != first.has_mins for p in parts):
            raise ValueError("only weights of one format stack")
        return dataclasses.replace(first, **{k: torch.cat([p._tensors()[k] for p in parts])
                                             for k in first._tensors()})

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] (fp32 in gguf-py's order, then cast)."""
        if self.fmt not in K_FORMATS:
            return dequantize(self.q, self.scales, self.mins, _BITS[self.fmt], dtype)
        n, k = self.shape
        q = self.q.to(torch.float32)
        if self.fmt == Q6_K:
            ds = self.scales.float().repeat_interleave(16, 1) * self.sc.float()
            w = ds.unsqueeze(-1) * (q - 32).view(n, k // 16, 16)
        else:
            ds = self.scales.float().repeat_interleave(8, 1) * self.sc.float()
            dm = self.mins.float().repeat_interleave(8, 1) * self.mn.float()
            w = ds.unsqueeze(-1) * q.view(n, k // GROUP, GROUP) - dm.unsqueeze(-1)
        return w.reshape(n, k).to(dtype)

    def tile(self) -> torch.Tensor:
        """The kernel's layout: uint8 [ceil(N/8), blocks along K, block bytes]."""
        if self.fmt not in K_FORMATS:
            return tile_weight(self.q, self.scales, self.mins, _BITS[self.fmt])
        n, k = self.shape
        nsb, nb = k // SUPER, k // GROUP
        q = self.q.to(torch.uint8)
        chunks = [_nibble_plane(q)]  # per 32-group: [G, pieces, 4]
        if self.fmt == Q5_K:
            chunks.append(_q5_plane((q >> 4).view(n, nb, GROUP)))
        elif self.fmt == Q6_K:
            chunks.append(_q6_plane((q >> 4).view(n, nb, GROUP)))
        planes = torch.cat(chunks, 2).view(n, nsb, -1, 4)  # per super-block: 8 groups' pieces
        parts = [planes, _bytes(self.scales.to(torch.float16), nsb, 2)]
        if self.fmt == Q6_K:  # [group][row][2 halves]
            parts.append(_bytes(self.sc.to(torch.int8), nsb, 2))
        else:  # dmin, then [sub-block][row] scales and mins
            parts += [_bytes(self.mins.to(torch.float16), nsb, 2), _bytes(self.sc.to(torch.uint8), nsb, 1),
                      _bytes(self.mn.to(torch.uint8), nsb, 1)]
        rows = -(-n // TILE_ROWS) * TILE_ROWS
        return torch.cat([_interleave(_padded(p, rows)) for p in parts], -1).contiguous()

    @classmethod
    def untile(cls, tiled: torch.Tensor, fmt: int, n: int, has_mins: bool) -> "QuantWeight":
        """Inverse of tile(): the first n rows."""
        if fmt not in K_FORMATS:
            return cls(fmt, *untile_weight(tiled, n, _BITS[fmt], has_mins))
        nsb = tiled.shape[1]
        pieces = {Q4_K: 4, Q5_K: 5, Q6_K: 6}[fmt]
        qb = pieces * 32 * 8  # q bytes of a super-block
        planes = _deinterleave(tiled[..., :qb], 8 * pieces, 4)[:n].reshape(n, nsb * 8, pieces, 4)
        q = unpack_int4(planes[:, :, :4].reshape(n, -1)).view(n, nsb * 8, GROUP)
        if fmt == Q5_K:
            q = q | (_q5_bits(planes[:, :, 4:5]) << 4)
        elif fmt == Q6_K:
            q = q | (_q6_bits(planes[:, :, 4:6]) << 4)
        q = q.reshape(n, -1).contiguous()

        def field(off: int, size: int, s: int, w: int, dtype: torch.dtype) -> torch.Tensor:
            v = _deinterleave(tiled[..., off:off + size], s, w)[:n].contiguous()
            return v.view(dtype).view(n, -1)

        d = field(qb, 16, 1, 2, torch.float16)
        if fmt == Q6_K:
            return cls(fmt, q, d, sc=field(qb + 16, 128, 8, 2, torch.int8))
        return cls(fmt, q, d, field(qb + 16, 16, 1, 2, torch.float16),
                   field(qb + 32, 64, 8, 1, torch.uint8), field(qb + 96, 64, 8, 1, torch.uint8))


def _align(n: int, to: int = 64) -> int:
    return -(-n // to) * to


def _tile_segments(weights: Sequence[QuantWeight]) -> tuple[torch.Tensor, list[tuple]]:
    """Row segments of different formats -> one flat uint8 buffer: the header kernels/quant.c
    reads (int64 S, then per segment fmt, has_mins, rows, byte offset), each segment's tiles
    at a 64-byte aligned offset. Also the segments' (fmt, has_mins, rows, offset, shape)."""
    tiles = [w.tile() for w in weights]
    at = _align(8 * (1 + 4 * len(weights)))
    segs = []
    for w, t in zip(weights, tiles):
        segs.append((w.fmt, w.has_mins, w.shape[0], at, tuple(t.shape)))
        at += _align(t.numel())
    buf = torch.zeros(at, dtype=torch.uint8, device=tiles[0].device)
    words = [len(weights)] + [v for f, m, r, o, _ in segs for v in (f, int(m), r, o)]
    head = torch.tensor(words, dtype=torch.int64).view(torch.uint8)
    buf[:head.numel()] = head.to(buf.device)
    for (_, _, _, off, _), t in zip(segs, tiles):
        buf[off:off + t.numel()] = t.reshape(-1)
    return buf, segs


# --- modules ------------------------------------------------------------------------------------

class QuantLinear(nn.Module):
    """A frozen linear layer over a quantized weight (see the module docstring)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
                 bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> None:
        """A weight in a legacy format (bits 4, 5 or 8) from its parts; `of` takes any format."""
        super().__init__()
        if bits not in (4, 5, 8):
            raise ValueError(f"bits must be 4, 5 or 8, not {bits}")
        self._build([QuantWeight(bits, q, scales, mins)], bias, dtype)

    @classmethod
    def of(cls, weights: QuantWeight | Sequence[QuantWeight], bias: torch.Tensor | None = None,
           dtype: torch.dtype = torch.float32):
        """A module over one weight, or over row segments (a fused projection whose parts
        differ in format; consecutive parts of one format are stacked into one segment)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._build([weights] if isinstance(weights, QuantWeight) else list(weights), bias, dtype)
        return self

    def _build(self, weights: list[QuantWeight], bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        merged: list[list[QuantWeight]] = []
        for w in weights:
            if merged and (merged[-1][0].fmt, merged[-1][0].has_mins) == (w.fmt, w.has_mins):
                merged[-1].append(w)
            else:
                merged.append([w])
        weights = [QuantWeight.cat(g) if len(g) > 1 else g[0] for g in merged]
        if len({w.shape[1] for w in weights}) != 1 or len(weights) > MAX_SEGMENTS:
            raise ValueError(f"segments must share in_features, at most {MAX_SEGMENTS} of them")
        self.out_features = sum(w.shape[0] for w in weights)
        self.in_features = weights[0].shape[1]
        self.dtype = dtype  # the activations' dtype: outputs are cast back to it
        self.bits = max(_BITS[w.fmt] for w in weights)
        self.has_mins = weights[0].has_mins
        bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.register_buffer("bias", bias)
        if len(weights) == 1:
            self.fmt, self.segments = weights[0].fmt, None
            tiled = weights[0].tile()
        else:
            self.fmt = MULTI
            tiled, self.segments = _tile_segments(weights)
        self.register_buffer("tiled", tiled)
        self.register_buffer("dense", None)
        self._ptrs: tuple | None = None
        if tiled.device.type != "cpu":
            self._unpack()

    def quant_weights(self) -> list[QuantWeight]:
        """The weight's segments (one but for mixed formats) in rows form, from the tiled copy."""
        if self.tiled is None:
            raise ValueError("this module holds an unpacked float weight, not its blocks")
        if self.segments is None:
            return [QuantWeight.untile(self.tiled, self.fmt, self.out_features, self.has_mins)]
        return [QuantWeight.untile(self.tiled[off:off + math.prod(shape)].view(shape), fmt, rows, mins)
                for fmt, mins, rows, off, shape in self.segments]

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q, scales, mins) of a legacy-format module."""
        (w,) = self.quant_weights()
        if w.fmt in K_FORMATS:
            raise ValueError("a K-quant weight has more parts: use quant_weights()")
        return w.q, w.scales, w.mins

    @classmethod
    def from_float(cls, linear: nn.Linear, bits: int) -> "QuantLinear":
        q, s, m = quantize_weight(linear.weight, bits)
        return cls(q, s, m, bits, linear.bias, linear.weight.dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.dense is not None:
            return self.dense.to(dtype)
        return torch.cat([w.dequantize(dtype) for w in self.quant_weights()])

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:  # off the CPU: the float copy made once (_unpack)
            return F.linear(x.to(self.dense.dtype), self.dense, self.bias).to(x.dtype)
        lib = _lib() if x.device.type == "cpu" else None
        if lib is not None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            return self._kernel(lib, x)  # the decode path: no reshapes or casts to pay for
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if lib is None:  # no kernel: the torch path
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
                         self.out_features, self.fmt, b, y.data_ptr(), torch.get_num_threads())
        return y

    def _unpack(self) -> None:
        """Off the CPU: one float copy of W in the model dtype, made once (a dequantize per
        call would read and write the whole weight in float every step)."""
        self.dense = self.dequantized(self.dtype)
        self.tiled = None
        if self.bias is not None:
            self.bias = self.bias.to(self.dtype)

    def _apply(self, fn, *args, **kwargs):
        self._ptrs = None  # .to() / .share_memory_() may move the buffers
        out = super()._apply(fn, *args, **kwargs)
        if self.tiled is not None and self.tiled.device.type != "cpu":  # off the kernel's device
            self._unpack()
        return out

    def extra_repr(self) -> str:
        fmts = FORMAT_NAMES.get(self.fmt) or "+".join(FORMAT_NAMES[s[0]] for s in self.segments)
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={fmts}, "
                f"mins={self.has_mins}, bias={self.bias is not None}, unpacked={self.dense is not None}")


class QuantEmbedding(QuantLinear):
    """An embedding table in a quantized format (one, not segments): forward gathers rows
    (dequantized to the model dtype, as gguf-py does); `project` multiplies by the table, for a
    tied LM head."""

    def __init__(self, q, scales, mins, bits, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(q, scales, mins, bits, None, dtype)

    def _build(self, weights, bias, dtype) -> None:
        super()._build(weights, bias, dtype)
        if self.fmt == MULTI:
            raise ValueError("an embedding table is one format")
        self.num_embeddings, self.embedding_dim = self.out_features, self.in_features

    @classmethod
    def from_float(cls, embedding: nn.Embedding, bits: int) -> "QuantEmbedding":
        q, s, m = quantize_weight(embedding.weight, bits)
        return cls(q, s, m, bits, embedding.weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return F.embedding(ids, self.dense).to(self.dtype)
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        lib = _lib()
        if lib is None:  # the torch path: the tiles holding the ids, untiled
            tiles = self.tiled[flat // TILE_ROWS]
            w = QuantWeight.untile(tiles, self.fmt, tiles.shape[0] * TILE_ROWS, self.has_mins)
            pick = torch.arange(flat.numel()) * TILE_ROWS + flat % TILE_ROWS
            rows = w.rows(pick).dequantize()
        else:
            rows = torch.empty(flat.numel(), self.in_features, dtype=torch.float32)
            ptr = kernels.ptr
            lib.quant_gather(ptr(self.tiled), self.has_mins, self.fmt, self.in_features, ptr(flat),
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
