"""The Llama family's decode steps in one C call (kernels/decode_stack.c) instead of ~10 Python-
wrapped kernel calls per layer.

A decode step of a small model spends as long in Python around the kernels as in the kernels
(~150 us a layer on the default model, quantized). When a step is decode rows only, the stack
runs every layer in C with the same kernels, in the same order, on the same values, so its
logits equal the Python path's bit for bit; any other step runs the Python layers.

It applies (DecodeStack.build, once per model) to plain Llama-family layers (Llama, SmolLM2,
Mistral, Qwen2 with q|k|v bias, Qwen3 with head norms; llama.py hands build its layer classes, so
this module never imports it) whose four products run in a C kernel
(quantized: layers/quant.py's tiled CPU weights; fp32: layers/dense.py's few-row kernel, up to
its max_rows), with fp32 activations and an fp32, bf16 or fp16 KV cache read by the CPU paged
backend, without attention sinks or tensor parallelism; and per step (run) when every KV
group's metadata is decode rows only, written in full (no decode context parallelism).
LOOMSERVE_DECODE_STACK=0 turns it off.
"""

from __future__ import annotations

import ctypes
import os

import torch

from loomserve.execution import kernels
from loomserve.execution.attention import cpu_backend
from loomserve.execution.attention.cpu_backend import CpuPagedBackend, load_library
from loomserve.execution.layers import dense, fused, quant
from loomserve.execution.layers.norm import RMSNorm

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _Lin(ctypes.Structure):
    _fields_ = [("w", _P), ("bias", _P), ("n", _I64), ("k", _I64), ("bits", _I32), ("has_mins", _I32),
                ("dense", _I32), ("dtype", _I32), ("threads", _I32)]


class _Layer(ctypes.Structure):
    _fields_ = [("norm1", _P), ("norm2", _P), ("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin),
                ("down", _Lin), ("q_norm", _P), ("k_norm", _P), ("k_cache", _P), ("v_cache", _P),
                ("block_stride", _I64), ("group", _I32), ("norm_flags", _I32), ("qk_flags", _I32),
                ("qk_eps", _F), ("kv_dtype", _I32)]


class _Plan(ctypes.Structure):
    _fields_ = [("tables", _P), ("lens", _P), ("slot_blocks", _P), ("slot_offsets", _P), ("window", _I32), ("split", _I32),
                ("max_splits", _I32), ("threads", _I32)]


class _Model(ctypes.Structure):
    _fields_ = [("matmul", _P), ("dense", _P), ("norm", _P), ("rope", _P), ("silu", _P), ("attend", _P),
                ("heads", _I32), ("kv_heads", _I32), ("head_dim", _I32), ("hidden", _I32),
                ("inter", _I32), ("block_size", _I32), ("eps", _F), ("scale", _F)]


class _Work(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("h", "qkv", "q", "attn", "gate_up", "act", "scratch")]


def enabled() -> bool:
    return os.environ.get("LOOMSERVE_DECODE_STACK", "1") not in ("0", "false", "no")


def _fn(lib, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def _lin(mod, keep: list) -> _Lin | None:
    """The product's struct: a quantized module's tiled weight, or an fp32 dense kernel layer
    (with the thread count and fp32 bias its forward uses; `keep` holds that bias alive)."""
    if isinstance(mod, quant.QuantLinear):
        if mod.tiled is None or mod.dtype != torch.float32:
            return None
        bias = None if mod.bias is None else mod.bias.data_ptr()
        return _Lin(mod.tiled.data_ptr(), bias, mod.out_features, mod.in_features, mod.fmt,
                    mod.has_mins, 0, 0, 0)
    if (isinstance(mod, dense.DenseLinear) and dense.available() and dense.kernel_fits(mod.weight)
            and mod.weight.dtype == torch.float32 and mod.max_rows > 0):
        bias = None if mod.bias is None else mod.bias.detach().float().contiguous()
        keep.append(bias)
        return _Lin(mod.weight.data_ptr(), None if bias is None else bias.data_ptr(), mod.out_features,
                    mod.in_features, 0, 0, 1, 0, dense._threads(mod.weight))
    return None


def _products(layer) -> tuple:
    a, mlp = layer.self_attn, layer.mlp
    return a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj


def _norm_ok(norm) -> bool:
    return (type(norm) is RMSNorm and norm._kernel_flags is not None and norm.weight.is_cpu
            and norm.weight.dtype == torch.float32 and norm.weight.is_contiguous())


class DecodeStack:
    """The C stack bound to one model's weights and KV views (see the module docstring)."""

    def __init__(self, lib, model_struct: _Model, layers: list) -> None:
        self.lib, self.model_struct, self.layers = lib, model_struct, layers
        self.attn_mods = [la.self_attn for la in layers]
        self.structs = None
        self.cache_ptr = None
        self.steps = 0  # steps the stack ran (tests check it really did)
        # dense layers run their kernel up to max_rows rows and torch's GEMM past it: so must we
        self.max_rows = min((m.max_rows for la in layers for m in _products(la)
                             if isinstance(m, dense.DenseLinear)), default=1 << 30)

    @classmethod
    def build(cls, model, layer_type: type, attention_type: type, mlp_type: type
              ) -> "DecodeStack | None":
        """The stack for `model` (a LlamaForCausalLM), or None where it does not apply: every
        layer must be exactly `layer_type` with `attention_type` and `mlp_type` blocks, the
        layers whose computation the C stack repeats."""
        if not enabled() or model.tp is not None or not model.carries_residual:
            return None
        libs = (kernels.bind("decode_stack", {"decode_stack": (
                    [_P, _P, ctypes.c_int, _P, _P, _P, ctypes.c_int, _P, _P, _P, ctypes.c_int],
                    ctypes.c_int)}), quant._lib(), fused.library(), load_library())
        if any(lib is None for lib in libs):
            return None
        cfg, rot = model.config, model.rotary
        layers = list(model.model.layers)
        if rot is None or 2 * rot.half != cfg.head_dim or rot.cos.dtype != torch.float32:
            return None
        # paged_attention.c's limits (MAX_GROUP, MAX_HEAD_DIM): past them it would refuse mid-stack
        if cfg.num_heads % cfg.num_kv_heads or cfg.num_heads // cfg.num_kv_heads > 64 or cfg.head_dim > 256:
            return None
        for layer in layers:
            a = layer.self_attn
            if (type(layer) is not layer_type or type(a) is not attention_type
                    or type(layer.mlp) is not mlp_type
                    or a.sinks is not None or not _norm_ok(layer.input_layernorm)
                    or not _norm_ok(layer.post_attention_layernorm)
                    or any(_lin(m, []) is None for m in _products(layer))
                    or (a.q_norm is not None and not (_norm_ok(a.q_norm) and fused._head_norms_fit(
                        a.q_norm, a.k_norm, torch.float32, cfg.head_dim)))):
                return None
        first = layers[0]
        eps = first.input_layernorm.eps
        if any(la.input_layernorm.eps != eps or la.post_attention_layernorm.eps != eps
               or la.self_attn.scale != first.self_attn.scale for la in layers):
            return None
        st, q, f, pa = libs
        ms = _Model(_fn(q, "quant_matmul"), _fn(dense._lib(), "dense_matmul") if dense.available() else None,
                    _fn(f, "rms_norm"), _fn(f, "rope_inplace"),
                    _fn(f, "silu_and_mul"), _fn(pa, "paged_decode"), cfg.num_heads, cfg.num_kv_heads,
                    cfg.head_dim, cfg.hidden_size, first.mlp.intermediate, 0,
                    eps, first.self_attn.scale)
        return cls(st, ms, layers)

    def _bind_caches(self, groups: list[int]) -> bool:
        """Layer structs over the current KV views (rebuilt if the runner re-allocates them)."""
        a0 = self.attn_mods[0]
        if a0.k_cache is None:
            return False
        key = (a0.k_cache.data_ptr(), tuple(groups))
        if self.cache_ptr == key:
            return True
        structs, keep = (_Layer * len(self.layers))(), []
        for i, (layer, a) in enumerate(zip(self.layers, self.attn_mods)):
            k, v = a.k_cache, a.v_cache
            kvs = k.shape[2] * k.shape[3]
            if (k.dtype not in cpu_backend.KV_DTYPES or k.stride()[1:] != (kvs, k.shape[3], 1)
                    or v.stride() != k.stride() or v.dtype != k.dtype):
                return False
            qn = a.q_norm
            structs[i] = _Layer(
                layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                *(_lin(m, keep) for m in _products(layer)),
                None if qn is None else qn.weight.data_ptr(), None if qn is None else a.k_norm.weight.data_ptr(),
                k.data_ptr(), v.data_ptr(), k.stride(0), groups[i], layer.input_layernorm._kernel_flags,
                0 if qn is None else qn._kernel_flags, 0.0 if qn is None else qn.eps,
                cpu_backend.kv_code(k.dtype, torch.float32))  # the stack's queries are fp32
            if layer.post_attention_layernorm._kernel_flags != structs[i].norm_flags:
                return False
        self.model_struct.block_size = self.attn_mods[0].k_cache.shape[1]
        self.structs, self.cache_ptr, self.keep = structs, key, keep
        return True

    def run(self, x: torch.Tensor, rope: tuple, metas: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(last down product, residual) of a decode-only step, or None (run the Python layers).
        x: [M, hidden] fp32 embeddings (overwritten); metas: each layer's AttentionMetadata."""
        if fused.library() is None or quant._lib() is None or not dense.available():
            return None  # a kernel switched off since build (LOOMSERVE_FUSED, tests): Python layers
        n = x.shape[0]
        uniq: list = []
        for meta in metas:
            if not any(meta is u for u in uniq):
                if (meta.prefills or meta.write_rows is not None or meta.num_decode != n
                        or not isinstance(meta.backend, CpuPagedBackend)
                        or meta.slot_blocks.dtype != torch.int64 or meta.slot_offsets.dtype != torch.int64
                        or not meta.slot_blocks.is_contiguous() or not meta.slot_offsets.is_contiguous()):
                    return None
                uniq.append(meta)
        groups = [next(j for j, u in enumerate(uniq) if u is meta) for meta in metas]
        if (x.dtype != torch.float32 or not x.is_contiguous() or not self._bind_caches(groups)
                or n > self.max_rows):
            return None
        ms = self.model_struct
        plans, need = (_Plan * len(uniq))(), 0
        for j, meta in enumerate(uniq):
            ptrs, lens, split, max_splits, threads, kvh = meta.backend._decode_plan(meta, ms.kv_heads, ms.heads)
            plans[j] = _Plan(ptrs.ctypes.data, lens.ctypes.data, meta.slot_blocks.data_ptr(),
                             meta.slot_offsets.data_ptr(), meta.sliding_window or 0, split, max_splits, threads)
            need = max(need, n * ms.heads * max_splits * (ms.head_dim + 2))
            meta.backend.calls["decode_kernel"] += groups.count(j)
        cos, sin, _ = rope
        qs, kvs = ms.heads * ms.head_dim, ms.kv_heads * ms.head_dim
        sizes = (ms.hidden, qs + 2 * kvs, qs, qs, 2 * ms.inter, ms.inter)
        buf = torch.empty(n * sum(sizes) + need, dtype=torch.float32)
        offs, at = [], buf.data_ptr()
        for s in sizes:
            offs.append(at)
            at += n * s * 4
        work = _Work(*offs, at)
        res = torch.empty_like(x)
        cos, sin = cos.contiguous(), sin.contiguous()
        rc = self.lib.decode_stack(ctypes.byref(ms), self.structs, len(self.layers), plans, x.data_ptr(),
                                   res.data_ptr(), n, cos.data_ptr(), sin.data_ptr(), ctypes.byref(work),
                                   torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"decode stack failed ({rc}) after writing this step's K/V")
        self.steps += 1
        layers = len(self.layers)  # the fused ops ran, from C: count them as layers/fused.py does
        fused.calls.update(rms_norm=2 * layers, rope=layers, silu_and_mul=layers)
        return x, res
