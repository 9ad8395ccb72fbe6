"""Kimi Delta Attention (KDA, Kimi Linear's linear attention) over per-request state pages.

KDA is the gated delta rule of layers/gated_deltanet.py with one forget gate per key CHANNEL
instead of one per head: per head the state S [k_dim, v_dim] decays row by row,

    S_t = diag(alpha_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - (diag(alpha_t) S_{t-1})^T k_t),
    o_t = S_t^T q_t,     log alpha_t = -exp(A_log) * softplus(f_b(f_a(x_t)) + dt_bias)  [k_dim]

Everything else is Gated DeltaNet's: short causal convs (SiLU) on q, k and v, L2-normalized q and
k (q scaled by k_dim^-1/2), beta = sigmoid(b(x)), and the same state plumbing (conv window and
recurrent state per layer in a LinearStateSpec, checkpoints at save points, decode rows in one
vectorized step: gated_deltanet.delta_rule). Output: RMSNorm per head, times sigmoid of a
low-rank gate g_b(g_a(x)), all in fp32, then o_proj. Heads have no GQA: q, k and v heads match.

Chunked form (prefill): as Gated DeltaNet's WY/UT form, with the per-channel decays inside the
products: for a chunk with log-decay prefix sums c_t [k_dim],
    A[t, s] = beta_t sum_d k_t[d] k_s[d] exp(c_t[d] - c_s[d])   (s < t)
formed per 64-token chunk in 16-token sub-chunks (`_intra`): matmuls through the end of a
sub-chunk across them, and within one around its middle row, or with the exact [16, 16, k_dim]
decay tensor where a channel forgets so fast that the factors could overflow.

State (LinearStateSpec.state_shapes of one layer): the conv window [3 * heads * head_dim,
kernel - 1] and S [heads, head_dim, head_dim], fp32 in the page whatever the model dtype.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.layers.gated_deltanet import (
    causal_conv,
    delta_rule,
    l2norm,
    split_batch,
)
from loomserve.execution.layers.norm import RMSNorm
from loomserve.execution.layers.state import StateBatch
from loomserve.execution.parallel.state import TPGroup
from loomserve.execution.parallel.tensor_parallel import part

CHUNK, SUB = 64, 16
# Within a sub-chunk whose log decays span at most this, exp(c_t - c_s) is taken as
# exp(c_t - m) exp(m - c_s) around the middle row m: both factors within e^+-SPAN, far from
# fp32's over/underflow (e^+-87), and their product exact to rounding. Wider sub-chunks (a
# channel forgetting fast) take the exact [sub, sub, d] decay tensor.
SPAN = 40.0


def _intra(q: torch.Tensor, k: torch.Tensor, kb: torch.Tensor, c: torch.Tensor, sub: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's key-key and query-key products under the per-channel decays, [H, C, C] each:
    A[t, s] = kb_t . (k_s * exp(c_t - c_s)) for s < t, QK[t, s] = q_t . (...) for s <= t
    (q, k, kb, c: [H, C, d]; c the log-decay prefix sums, non-increasing). Pairs across
    sub-chunks of `sub` rows factor through the end r of the key's sub-chunk, exp(c_t - r)
    exp(r - c_s), two factors <= 1: matmuls (FLA's sub-chunking). Pairs within a sub-chunk
    factor around its middle row where the decays span <= SPAN, else use the exact decay
    tensor. No exponent ever exceeds SPAN, so nothing overflows however fast a channel forgets."""
    h, n, d = k.shape
    blocks = n // sub
    cs, ks = c.view(h, blocks, sub, d), k.view(h, blocks, sub, d)
    ref = cs[:, :, -1:]  # [H, blocks, 1, d]: the end of each key sub-chunk
    right = (ks * (ref - cs).exp()).transpose(-1, -2)  # [H, blocks, d, sub]
    left = (c.unsqueeze(1) - ref).clamp_max(0).exp()  # [H, blocks, C, d]; rows <= r masked below
    later = torch.arange(n, device=k.device) // sub
    later = later[:, None] > later[None, :]
    causal = torch.ones(sub, sub, dtype=torch.bool, device=k.device).tril()
    mid = cs[:, :, sub // 2:sub // 2 + 1]
    k_mid = ks * (mid - cs).clamp(-SPAN, SPAN).exp()  # [H, blocks, sub, d]
    to_mid = (cs - mid).clamp(-SPAN, SPAN).exp()
    wide = (cs[:, :, 0] - cs[:, :, -1]).amax(-1) > SPAN  # [H, blocks]
    if wide.any():  # exact decay tensors for those sub-chunks only
        cw = cs[wide]
        decay = (cw.unsqueeze(2) - cw.unsqueeze(1)).masked_fill(~causal[..., None], float("-inf")).exp()
        k_to = decay * ks[wide].unsqueeze(1)  # [wide, t, s, d]
    out = []
    for x in (kb, q):
        m = ((x.unsqueeze(1) * left) @ right).permute(0, 2, 1, 3).reshape(h, n, n)
        m = m.masked_fill(~later, 0.0)
        xs = x.view(h, blocks, sub, d)
        diag = ((xs * to_mid) @ k_mid.transpose(-1, -2)).masked_fill(~causal, 0.0)
        if wide.any():
            diag[wide] = (k_to * xs[wide].unsqueeze(2)).sum(-1)
        m.view(h, blocks, sub, blocks, sub).diagonal(0, 1, 3).copy_(diag.permute(0, 2, 3, 1))
        out.append(m)
    return out[0], out[1]


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK, sub: int = SUB
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. q, k: [len, heads, k_dim] (normalized, q scaled); v: [len, heads, v_dim];
    g (log decay, <= 0): [len, heads, k_dim]; beta: [len, heads]; state [heads, k_dim, v_dim].
    Returns o [len, heads, v_dim] and the state after the last token (fp32)."""
    n = q.shape[0]
    pad = (-n) % chunk

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [len, H, ...] -> [H, chunks, chunk, ...]
        t = t.float().movedim(0, 1)
        if pad:
            t = F.pad(t, (0, 0, 0, pad) if t.dim() == 3 else (0, pad))
        return t.reshape(t.shape[0], -1, chunk, *t.shape[2:])

    # Padding has g = 0 and beta = k = 0: it neither decays nor writes the state.
    q, k, v, g, beta = blocks(q), blocks(k), blocks(v), blocks(g), blocks(beta)
    cum = g.cumsum(-2)  # [H, chunks, chunk, k_dim]: log decay from the chunk's start
    out = torch.empty_like(v)
    s = state.float()
    for c in range(q.shape[1]):
        qc, kc, vc, cc, bc = q[:, c], k[:, c], v[:, c], cum[:, c], beta[:, c].unsqueeze(-1)
        kb = kc * bc
        a, qk = _intra(qc, kc, kb, cc, sub)  # the solve ignores a's diagonal
        u = torch.linalg.solve_triangular(a, vc * bc, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(a, kb * cc.exp(), upper=False, unitriangular=True)
        u = u - w @ s
        out[:, c] = (qc * cc.exp()) @ s + qk @ u
        last = cc[:, -1:]  # [H, 1, d]
        s = s * last.exp().transpose(-1, -2) + (kc * (last - cc).exp()).transpose(-1, -2) @ u
    out = out.reshape(out.shape[0], -1, out.shape[-1])[:, :n]
    return out.movedim(0, 1), s


class KimiDeltaAttention(nn.Module):
    """KDA on flattened rows [tokens, hidden] with a StateBatch. in_proj fuses HF's q, k, v,
    f_a, g_a and b projections, rows [q | k | v | f_a | g_a | b]: one matmul per layer, and the
    conv input one contiguous slice."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int,
                 eps: float) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.conv_kernel = num_heads, head_dim, conv_kernel
        self.size = num_heads * head_dim
        self.conv_dim = 3 * self.size
        self.splits = [self.conv_dim, head_dim, head_dim, num_heads]
        self.in_proj = nn.Linear(hidden_size, sum(self.splits), bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel))
        self.f_b_proj = nn.Linear(head_dim, self.size, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.size))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.g_b_proj = nn.Linear(head_dim, self.size, bias=False)
        self.o_norm = RMSNorm(head_dim, eps, scale_in_fp32=True, gate="after", gate_act="sigmoid")
        self.o_proj = nn.Linear(self.size, hidden_size, bias=False)
        # Set by the runner: (conv [num_blocks, conv_dim, kernel-1], recurrent [num_blocks, H, D, D]).
        self.state_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def _apply(self, fn, recurse=True):
        # dt_bias stays fp32 in a bf16 model, as transformers keeps it: softplus of a bias near
        # -5 moves the decay rate by ~2% in bf16's rounding.
        super()._apply(fn, recurse)
        if self.dt_bias.dtype != torch.float32:
            self.dt_bias.data = self.dt_bias.data.float()
        return self

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.conv_dim, self.conv_kernel - 1), (self.num_heads, self.head_dim, self.head_dim))

    def forward(self, x: torch.Tensor, sb: StateBatch) -> torch.Tensor:
        n, h, d = x.shape[0], self.num_heads, self.head_dim
        conv_cache, rec_cache = self.state_cache
        mixed, f_a, g_a, b = self.in_proj(x).split(self.splits, dim=-1)
        decodes, prefills = split_batch(sb)
        mixed = causal_conv(mixed, conv_cache, self.conv_weight, None, decodes, prefills)
        q, k, v = mixed.split(self.size, dim=-1)
        q = l2norm(q.float().view(n, h, d)) * d ** -0.5
        k = l2norm(k.float().view(n, h, d))
        forget = self.f_b_proj(f_a).float() + self.dt_bias.float()
        g = -self.A_log.float().exp()[:, None] * F.softplus(forget.view(n, h, d))
        core = delta_rule(q, k, v.view(n, h, d), g, b.float().sigmoid(), rec_cache, decodes,
                          prefills, chunk_kda)
        # transformers' gated norm runs in fp32 and casts once
        o = self.o_norm(core, self.g_b_proj(g_a).view(n, h, d), torch.float32).to(x.dtype)
        return self.o_proj(o.reshape(n, self.size))

    # --- HF weights -------------------------------------------------------------------------------

    def load_hf(self, name: str, tensor: torch.Tensor) -> str:
        """Copy one HF tensor (name relative to the layer, e.g. 'q_proj.weight'); returns the
        key it counts under, for the loader's coverage check."""
        rows = _IN_PROJ_ROWS.get(name)
        if rows is not None:
            off = {"q": 0, "k": self.size, "v": 2 * self.size, "f_a": self.conv_dim,
                   "g_a": self.conv_dim + self.head_dim, "b": self.conv_dim + 2 * self.head_dim}[rows]
            _copy(self.in_proj.weight.data.narrow(0, off, tensor.shape[0]), tensor, name)
            return f"in_proj.weight#{rows}"
        if name == "conv1d.weight":  # transformers' stacked conv: all three parts
            _copy(self.conv_weight.data, tensor.reshape(self.conv_dim, -1), name)
            return "conv_weight"
        if name in _CONVS:  # the Hub's q/k/v convs: their rows of the one conv
            j = _CONVS.index(name)
            _copy(self.conv_weight.data.narrow(0, j * self.size, self.size),
                  tensor.reshape(self.size, -1), name)
            return f"conv_weight#{'qkv'[j]}"
        target = _RENAMED.get(name, name)
        params = dict(self.named_parameters())
        if target not in params:
            raise ValueError(f"unexpected Kimi Delta Attention weight {name!r}")
        _copy(params[target].data, tensor.reshape(params[target].shape) if target == "A_log" else tensor,
              name)
        return target

    def hf_param_keys(self) -> set[str]:
        keys = {n for n, _ in self.named_parameters()} - {"in_proj.weight", "conv_weight"}
        return (keys | {f"in_proj.weight#{r}" for r in _IN_PROJ_ROWS.values()}
                | {f"conv_weight#{x}" for x in "qkv"})


# HF's projections of x -> their rows of in_proj; HF names of the forget gate's parameters.
_IN_PROJ_ROWS = {"q_proj.weight": "q", "k_proj.weight": "k", "v_proj.weight": "v",
                 "forget_gate.f_a_proj.weight": "f_a", "g_a_proj.weight": "g_a", "b_proj.weight": "b"}
_CONVS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")
_RENAMED = {"forget_gate.f_b_proj.weight": "f_b_proj.weight", "forget_gate.dt_bias": "dt_bias",
            "forget_gate.A_log": "A_log"}


def tp_slice(name: str, t: torch.Tensor, tp: TPGroup, heads: int) -> torch.Tensor:
    """This rank's slice of one HF KDA tensor (`name` relative to the layer): heads split, so
    a rank's conv channels, forget gates and recurrent state are its heads' only. The low-rank
    inputs (f_a, g_a) and the per-head norm stay whole; their up-projections split by head."""
    if name == "conv1d.weight":  # rows [q | k | v], each by head
        return torch.cat([part(x, 0, heads, tp) for x in t.chunk(3, dim=0)])
    if name in _CONVS or name in ("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                  "b_proj.weight", "g_b_proj.weight",
                                  "forget_gate.f_b_proj.weight", "forget_gate.dt_bias"):
        return part(t, 0, heads, tp)
    if name == "forget_gate.A_log":  # one per head, stored [1, 1, heads, 1]
        return part(t.reshape(-1), 0, heads, tp)
    if name == "o_proj.weight":
        return part(t, 1, heads, tp)
    return t  # f_a, g_a, o_norm


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name!r}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)
