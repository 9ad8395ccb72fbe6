"""Weight layouts for the CPU matrix products, chosen once after loading.

A decode step multiplies one row per sequence by every weight matrix: a streaming read of the
weights, so its speed is the memory bandwidth the GEMM kernel reaches (and, for bf16 at many
rows, its compute rate). What each dtype gets on the CPU:

- fp32 and bf16, where the dense kernel builds (layers/dense.py) and oneDNN has no bf16
  kernels of its own: weights keep torch's [out, in] layout; products of up to DENSE_ROWS rows
  (a tied LM head's too) run in kernels/dense.c, which streams the weight rows at close to a
  plain read's bandwidth, more rows in torch. Measured on the 2-core AMD benchmark VM
  (benchmarks/dense_matmul.py): 1.2-4.5x torch's GEMMs at 1 to 64 rows, the default model's
  single-stream fp32 decode 1.4x.
- fp32 without the kernel (MKL GEMM): the same matrix stored input-major ([in, out]) streams
  faster than [out, in] at one row. The parameter keeps its shape [out, in] and its values;
  only its strides change (a transposed view of a contiguous [in, out] buffer).
- bf16 with oneDNN's bf16 kernels (AMX / AVX-512-BF16): a weight reordered once into oneDNN's
  blocked layout is 1.3-1.45x faster at 1 to 256 rows; without it oneDNN reorders the plain
  weight inside every call. A layer is packed only if a probe product is bit-identical to the
  plain kernel's (some small shapes get other kernels whose rounding differs), so packing
  never changes an output. Each nn.Linear becomes a PackedLinear holding only the packed
  copy. A tied LM head (the embedding matrix) gets a packed copy beside the embedding, which
  still serves row gathers.

Quantized modules (layers/quant.py: QuantLinear, a QuantEmbedding serving as the tied LM head)
are not nn.Linear / nn.Embedding weights and keep their own layout. Other devices and dtypes
keep the default layout. The packed path uses PyTorch's oneDNN ops
(the ones torch.compile's CPU backend emits); if they are missing or refuse a weight, that
weight stays a plain nn.Linear.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.layers import dense
from loomserve.execution.layers.parallel_linear import argmax_logits, gather_logits
from loomserve.execution.layers.quant import QuantEmbedding

log = logging.getLogger(__name__)

# Rows up to which the dense kernel (layers/dense.py) runs a product, fp32 and bf16 alike: it
# beat torch at every row count to 64 on the benchmark VM (benchmarks/dense_matmul.py).
DENSE_ROWS = 64


def to_input_major(param: torch.Tensor) -> None:
    """Re-lay a 2-D [out, in] parameter in place as a view of a contiguous [in, out] buffer."""
    if param.dim() == 2 and param.is_contiguous():
        param.data = param.data.t().contiguous().t()


def onednn_bf16_available() -> bool:
    try:
        return (torch.backends.mkldnn.is_available()
                and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """A frozen linear layer whose weight oneDNN reordered for its bf16 kernels."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none",
                                                  [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


def _packed(weight: torch.Tensor, bias: torch.Tensor | None,
            batch_hint: int) -> PackedLinear | None:
    """A PackedLinear of the weight, or None where oneDNN refuses it or rounds differently."""
    try:
        packed = PackedLinear(weight, bias, batch_hint)
        # Packing must not change a single bit: oneDNN picks other kernels for some small
        # shapes, whose rounding differs; those layers stay plain.
        gen = torch.Generator().manual_seed(0)
        for rows in (1, 33):
            probe = torch.randn(rows, packed.in_features, generator=gen).to(weight.dtype)
            if not torch.equal(packed(probe), F.linear(probe, weight, bias)):
                return None
        return packed
    except RuntimeError as e:  # an op or shape oneDNN does not take: keep the plain layer
        log.debug("keeping a plain linear layer: %s", e)
        return None


def _replace_linears(module: nn.Module, batch_hint: int) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, _packed(child.weight, child.bias, batch_hint) or child)
        else:
            _replace_linears(child, batch_hint)


def optimize_cpu_layout(model: nn.Module, device: torch.device, dtype: torch.dtype,
                        tied_embedding: nn.Embedding | None, batch_hint: int = 32) -> str:
    """Re-lay `model`'s weights for the CPU kernels (see the module docstring); returns what was
    done, for the startup log. tied_embedding: the embedding that doubles as the LM head."""
    if device.type != "cpu":
        return "default"
    if isinstance(tied_embedding, QuantEmbedding):
        tied_embedding = None  # the quantized table is its own LM head (lm_head_logits)
    if dtype in (torch.float32, torch.bfloat16) and dense.available() \
            and not (dtype == torch.bfloat16 and onednn_bf16_available()):
        count = dense.replace_linears(model, DENSE_ROWS)
        if tied_embedding is not None:
            model.cpu_lm_head = dense.DenseLinear(tied_embedding.weight, None, DENSE_ROWS)
        return f"{count} linears with the dense kernel at <= {DENSE_ROWS} rows"
    if dtype == torch.float32:
        for m in model.modules():
            if isinstance(m, nn.Linear):
                to_input_major(m.weight)
        if tied_embedding is not None:
            to_input_major(tied_embedding.weight)
        return "input-major fp32"
    if dtype == torch.bfloat16 and onednn_bf16_available():
        _replace_linears(model, batch_hint)
        if tied_embedding is not None:
            model.cpu_lm_head = _packed(tied_embedding.weight, None, batch_hint)
        return "onednn-packed bf16"
    return "default"


def lm_head_logits(model: nn.Module, hidden: torch.Tensor, lm_head: nn.Module | None,
                   embedding: nn.Embedding) -> torch.Tensor:
    """Logits through the untied LM head, else through the embedding matrix (through the
    cpu_lm_head layer when optimize_cpu_layout made one). Under tensor parallelism (`model.tp`
    set) each rank has one vocabulary slice: the slices are joined on rank 0, the sampler's."""
    logits = _local_logits(model, hidden, lm_head, embedding)
    tp = getattr(model, "tp", None)
    if tp is None:
        return logits
    return gather_logits(logits, embedding.vocab_size, tp)


def lm_head_argmax(model: nn.Module, hidden: torch.Tensor, lm_head: nn.Module | None,
                   embedding: nn.Embedding) -> torch.Tensor:
    """Greedy ids of lm_head_logits' logits, the same on every tensor-parallel rank (no logits
    gathered: each rank's best of its vocabulary slice is all-gathered)."""
    logits = _local_logits(model, hidden, lm_head, embedding)
    tp = getattr(model, "tp", None)
    if tp is None:
        return logits.argmax(dim=-1)
    return argmax_logits(logits, embedding.vocab_size, tp)


def _local_logits(model: nn.Module, hidden: torch.Tensor, lm_head: nn.Module | None,
                  embedding: nn.Embedding) -> torch.Tensor:
    if lm_head is not None:
        return lm_head(hidden)
    if isinstance(embedding, QuantEmbedding):
        return embedding.project(hidden)
    head = getattr(model, "cpu_lm_head", None)  # a re-laid copy or view (optimize_cpu_layout)
    if head is not None:
        return head(hidden)
    return F.linear(hidden, embedding.weight)
