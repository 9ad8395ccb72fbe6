"""MXFP4 expert weights (OCP microscaling FP4, gpt-oss's format) kept as their 4-bit codes.

The format: a weight [N, K] (N output rows, K input columns) in blocks of 32 values along K;
each value an e2m1 code (0..15: FP4_VALUES) times its block's scale 2^(e - 127), e an e8m0
byte. HF checkpoints store, per projection of E stacked experts, `<proj>_blocks` uint8
[E, N, K/32, 16] (byte j of a block: value 2j in its low nibble, 2j+1 in its high) and
`<proj>_scales` uint8 [E, N, K/32]; transformers' dequantization (integrations/mxfp4.py:
convert_moe_packed_tensors) returns the float weight transposed, [E, K, N]. GGUF's MXFP4
(type 39) stores per block 1 e8m0 byte then 16 bytes, byte j holding value j (low) and j+16
(high): gguf_blocks_to_hf converts.

Mxfp4Experts holds E experts' projections as loaded (HF names, so the checkpoint's tensors load
by name) until pack() runs once after loading; then, by device:
- CPU with the kernel (kernels/mxfp4.c): each expert's weight tiled for it (8 rows per tile,
  tile_weight), [E, ceil(N/8), K/32, 136] uint8, the only copy kept; products never widen W;
- CPU without the kernel: the HF blocks stay, each call dequantizes its expert (torch);
- any other device: unpacked once to the dense [E, K, N] weight in the model dtype (what
  `--quantization none` loads), so no forward dequantizes anything.
Moving a packed module off the CPU later unpacks it the same way, once.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from loomserve.execution import kernels

BLOCK = 32
TILE_ROWS = 8
BLOCK_BYTES = 136  # per (tile, block): 8 rows x 16 code bytes, then 8 e8m0 bytes
# The e2m1 values of codes 0..15, and doubled (integers; the kernel's table, halved scale).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
_lib_cache: list = []


def _lib():
    """The mxfp4 kernel library with argtypes set, or None (then the torch path runs)."""
    if not _lib_cache:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        _lib_cache.append(kernels.bind("mxfp4", {
            "mxfp4_matmul": ([p, i64, i64, p, i64, p, p, i32], None),
            "mxfp4_dequantize": ([p, i64, i64, p], None),
        }))
    return _lib_cache[0]


# --- the format ---------------------------------------------------------------------------------

def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """fp32 2^(e - 128) of uint8 exponents, exact (subnormal for e < 2), as the kernel computes."""
    i = e.to(torch.int32)
    bits = torch.where(i >= 2, (i - 1) << 23, torch.full_like(i, 0x00200000) << i)
    return bits.view(torch.float32)


def hf_codes(blocks: torch.Tensor) -> torch.Tensor:
    """HF blocks uint8 [..., nb, 16] -> codes uint8 [..., nb * 32], one code per byte in order."""
    b = blocks.to(torch.uint8)
    codes = torch.stack([b & 0x0F, b >> 4], dim=-1)  # value 2j low, 2j+1 high
    return codes.reshape(*b.shape[:-2], b.shape[-2] * BLOCK)


def hf_blocks(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of hf_codes: codes [..., K] -> HF blocks [..., K/32, 16]."""
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // BLOCK, 16, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """HF blocks [..., N, K/32, 16] and scales [..., N, K/32] -> the weight [..., N, K]
    (not transposed), computed exactly in fp32 (doubled value times the halved scale)."""
    lut = torch.tensor(FP4_DOUBLED, dtype=torch.float32, device=blocks.device)
    v = lut[hf_codes(blocks).long()]
    v = v.view(*scales.shape, BLOCK) * e8m0_half(scales).unsqueeze(-1)
    return v.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK).to(dtype)


def tile_weight(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One weight's HF blocks [N, nb, 16] and scales [N, nb] -> the kernel's layout, uint8
    [ceil(N/8), nb, 136] (kernels/mxfp4.c): per tile and block the 8 rows' code bytes in 4-byte
    chunks, chunk-major, byte j holding value j (low) and j+16 (high), then 8 e8m0 bytes. Rows
    past N are zero codes (they add nothing; their outputs are never stored)."""
    n, nb = scales.shape
    tiles = -(-n // TILE_ROWS)
    codes = hf_codes(blocks).view(n, nb, 2, 16)  # [.., half, j]: value j and j+16
    q = codes[:, :, 0] | (codes[:, :, 1] << 4)  # [N, nb, 16], GGUF nibble order
    e = scales.to(torch.uint8)
    if tiles * TILE_ROWS != n:
        pad = tiles * TILE_ROWS - n
        q = torch.cat([q, q.new_zeros(pad, nb, 16)])
        e = torch.cat([e, e.new_zeros(pad, nb)])
    q = q.view(tiles, TILE_ROWS, nb, 4, 4).permute(0, 2, 3, 1, 4).reshape(tiles, nb, 128)
    e = e.view(tiles, TILE_ROWS, nb).permute(0, 2, 1)
    return torch.cat([q, e], dim=-1).contiguous()


def untile_weight(tiled: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of tile_weight: (HF blocks [n, nb, 16], scales [n, nb])."""
    tiles, nb, _ = tiled.shape
    q = tiled[..., :128].reshape(tiles, nb, 4, TILE_ROWS, 4).permute(0, 3, 1, 2, 4) \
        .reshape(tiles * TILE_ROWS, nb, 16)[:n]
    e = tiled[..., 128:].permute(0, 2, 1).reshape(tiles * TILE_ROWS, nb)[:n]
    codes = torch.stack([q & 0x0F, q >> 4], dim=2).reshape(n, nb * BLOCK)  # value j, then j+16
    return hf_blocks(codes), e.contiguous()


def gguf_blocks_to_hf(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF MXFP4 tensor's raw bytes, uint8 [..., N, nb * 17] (per block: the e8m0 byte,
    then 16 bytes, byte j holding value j low and j+16 high) -> HF (blocks [..., N, nb, 16],
    scales [..., N, nb])."""
    r = raw.to(torch.uint8).reshape(*raw.shape[:-1], raw.shape[-1] // 17, 17)
    q = r[..., 1:]
    codes = torch.cat([q & 0x0F, q >> 4], dim=-1)  # [..., N, nb, 32]: the block's values in order
    return hf_blocks(codes.reshape(*q.shape[:-2], q.shape[-2] * BLOCK)), r[..., 0].contiguous()


def interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's fused gate_up rows from GGUF's separate gate and up experts ([E, I, ...] each):
    rows g0 u0 g1 u1 ... ([E, 2I, ...]), the HF layout llama.cpp's converter split."""
    return torch.stack([gate, up], dim=2).reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])


# --- the module ---------------------------------------------------------------------------------

class Mxfp4Experts(nn.Module):
    """E experts' projections in MXFP4 (see the module docstring). projections: name ->
    (N output rows, K input columns) of one expert's weight; each loads from `<name>_blocks`,
    `<name>_scales` and (bias=True) `<name>_bias` [E, N]. project(name, e, x) = x @ W_e^T + b_e."""

    def __init__(self, num_experts: int, projections: dict[str, tuple[int, int]],
                 bias: bool = True) -> None:
        super().__init__()
        self.num_experts, self.shapes = num_experts, dict(projections)
        for name, (n, k) in self.shapes.items():
            if k % BLOCK:
                raise ValueError(f"MXFP4 {name}: {k} input columns are not a multiple of {BLOCK}")
            self.register_parameter(f"{name}_blocks", nn.Parameter(
                torch.empty(num_experts, n, k // BLOCK, 16, dtype=torch.uint8), requires_grad=False))
            self.register_parameter(f"{name}_scales", nn.Parameter(
                torch.empty(num_experts, n, k // BLOCK, dtype=torch.uint8), requires_grad=False))
            self.register_parameter(f"{name}_bias", nn.Parameter(torch.empty(num_experts, n))
                                    if bias else None)
        self.form = "blocks"  # blocks (as loaded; the torch fallback) | tiled (kernel) | dense
        self.packed = False  # pack() ran
        self._calls: dict = {}  # name -> the kernel call's pointers (_call); cleared on changes

    def __setattr__(self, name, value) -> None:
        super().__setattr__(name, value)
        if name != "_calls":  # a tensor replaced (expert parallelism slices them): new pointers
            self.__dict__.get("_calls", {}).clear()

    def __delattr__(self, name) -> None:
        super().__delattr__(name)
        self._calls.clear()

    def stacked_names(self) -> tuple[str, ...]:
        """The [E, ...] tensors of the current form (expert parallelism slices them)."""
        suffix = {"blocks": ("_blocks", "_scales"), "tiled": ("_tiled",), "dense": ("",)}[self.form]
        names = [f"{p}{s}" for p in self.shapes for s in suffix]
        return tuple(names + [f"{p}_bias" for p in self.shapes if getattr(self, f"{p}_bias") is not None])

    def pack(self) -> None:
        """Once, after loading: the form for the weights' device (module docstring)."""
        if self.packed:
            return
        self.packed = True
        device = getattr(self, f"{next(iter(self.shapes))}_blocks").device
        if device.type != "cpu":
            self.unpack()
            return
        for name in self.shapes:  # packed weights are buffers (count_weights counts them apart)
            blocks, scales = self._take(name)
            if _lib() is None:
                self.register_buffer(f"{name}_blocks", blocks)
                self.register_buffer(f"{name}_scales", scales)
            else:
                self.register_buffer(f"{name}_tiled", torch.stack(
                    [tile_weight(blocks[e], scales[e]) for e in range(blocks.shape[0])]))
        self.form = "blocks" if _lib() is None else "tiled"

    def _take(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, scales = getattr(self, f"{name}_blocks").data, getattr(self, f"{name}_scales").data
        for s in ("_blocks", "_scales"):
            delattr(self, name + s)
        return blocks, scales

    def _dtype(self) -> torch.dtype:
        b = next((getattr(self, f"{p}_bias") for p in self.shapes
                  if getattr(self, f"{p}_bias") is not None), None)
        return torch.float32 if b is None else b.dtype

    def unpack(self) -> None:
        """The dense form now (what pack() or a move does off the CPU): [E, K, N] weights in
        the model dtype, transformers' dequantized layout, unpacked one expert at a time."""
        if self.form == "dense":
            return
        self.packed, dtype = True, self._dtype()
        for name, (n, k) in self.shapes.items():
            if self.form == "tiled":
                tiled = getattr(self, f"{name}_tiled")
                delattr(self, f"{name}_tiled")
                parts = [untile_weight(t, n) for t in tiled]
            else:
                blocks, scales = self._take(name)
                parts = list(zip(blocks, scales))
            dense = torch.empty(len(parts), k, n, dtype=dtype, device=parts[0][0].device)
            for e, (b, s) in enumerate(parts):
                dense[e] = dequantize(b, s, dtype).t()
            self.register_parameter(name, nn.Parameter(dense, requires_grad=False))
        self.form = "dense"

    def _apply(self, fn, *args, **kwargs):
        self._calls.clear()  # .to() / .share_memory_() may move the tensors
        out = super()._apply(fn, *args, **kwargs)
        if self.packed and self.form != "dense" and self._device().type != "cpu":
            self.unpack()  # off the CPU: unpacked once, here
        return out

    def _device(self) -> torch.device:
        return getattr(self, self.stacked_names()[0]).device

    def weight(self, name: str, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert e's weight [N, K] as floats (tests, the fallback), from whichever form is kept."""
        n = self.shapes[name][0]
        if self.form == "dense":
            return getattr(self, name)[e].t().to(dtype)
        if self.form == "tiled":
            return dequantize(*untile_weight(getattr(self, f"{name}_tiled")[e], n), dtype)
        return dequantize(getattr(self, f"{name}_blocks")[e], getattr(self, f"{name}_scales")[e],
                          dtype)

    def packed_counts(self) -> tuple[int, int]:
        """(weights, bytes) of the packed expert weights once pack() ran ((0, 0) when dense;
        the biases, and dense weights, are parameters)."""
        if self.form == "dense":
            return 0, 0
        weights = self.num_experts * sum(n * k for n, k in self.shapes.values())
        return weights, sum(b.numel() * b.element_size() for b in self.buffers())

    def project(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x @ W_e^T + b_e [M, N], in x's dtype."""
        bias = getattr(self, f"{name}_bias")
        b = None if bias is None else bias[e]
        if self.form == "dense":
            w = getattr(self, name)[e]
            return x @ w if b is None else torch.addmm(b, x, w)
        lib = _lib() if self.form == "tiled" and x.device.type == "cpu" else None
        if lib is None:
            y = x.to(torch.float32) @ self.weight(name, e).t()
            return (y if b is None else y + b.float()).to(x.dtype)
        w, w_stride, b_ptr, b_stride, n, k = self._calls.get(name) or self._call(name)
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
        y = torch.empty(xf.shape[0], n, dtype=torch.float32)
        if xf.shape[0]:
            lib.mxfp4_matmul(xf.data_ptr(), xf.shape[0], k, w + e * w_stride, n,
                             None if b_ptr is None else b_ptr + e * b_stride, y.data_ptr(),
                             torch.get_num_threads())
        if b is not None and b_ptr is None:
            y += b.float()
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _call(self, name: str) -> tuple:
        """(tiled pointer, bytes per expert, fp32 bias pointer or None, its bytes per expert,
        N, K): ints, which ctypes passes fastest (two calls per routed expert per layer)."""
        tiled, bias = getattr(self, f"{name}_tiled"), getattr(self, f"{name}_bias")
        fused = bias is not None and bias.dtype == torch.float32 and bias.stride(1) == 1
        call = (tiled.data_ptr(), tiled.stride(0), bias.data_ptr() if fused else None,
                bias.stride(0) * 4 if fused else 0, *self.shapes[name])
        self._calls[name] = call
        return call

    def extra_repr(self) -> str:
        shapes = ", ".join(f"{k}={v}" for k, v in self.shapes.items())
        return f"experts={self.num_experts}, {shapes}, form={self.form}"
