"""Mamba2 mixer (SSD) over per-request state pages (Nemotron-H, Granite 4.0-H, Falcon-H1 style).

Per head h the state S is [head_dim, state_size]; a token with step dt = softplus(raw + dt_bias)
decays it by exp(dt A_h) and writes dt x B^T; the output reads it with C and adds D x:

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,     y_t = S_t C_t + D x_t

Decode seqs run that step once, vectorized over seqs and heads. A prefill chunk runs the chunked
SSD form: with L_t the cumulative log decay inside a chunk,
y = exp(L) C S_0^T + ((C B^T) o exp(L_t - L_s))_{s<=t} (dt x), and the end state is
exp(L_C) S_0 + (dt x o exp(L_C - L))^T B. B and C are shared by the heads of a group.

State (LinearStateSpec.state_shapes of one layer): the conv's last kernel-1 inputs
[conv_dim, kernel - 1] (conv_dim = heads * head_dim + 2 * groups * state_size) and S
[heads, head_dim, state_size], fp32 in the page.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.layers.gated_deltanet import (
    causal_conv,
    decode_waves,
    gather_states,
    save_offsets,
    segments,
    split_batch,
)
from loomserve.execution.layers.norm import RMSNorm
from loomserve.execution.layers.state import StateBatch
from loomserve.execution.parallel.state import TPGroup
from loomserve.execution.parallel.tensor_parallel import bias_once, part

CHUNK = 64


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. x [len, H, P]; dt [len, H] (after softplus); a [H] (negative); b, c
    [len, H, N] (already expanded from groups); state [H, P, N] fp32.
    Returns y [len, H, P] without the D skip, and the state after the last token (fp32)."""
    n = x.shape[0]
    pad = (-n) % chunk

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [len, H, ...] -> [H, chunks, chunk, ...]
        t = t.float().movedim(0, 1)
        if pad:  # padded steps have dt = 0: no decay, no write
            t = F.pad(t, (0, 0, 0, pad) if t.dim() == 3 else (0, pad))
        return t.reshape(t.shape[0], -1, chunk, *t.shape[2:])

    xdt, dt, b, c = blocks(x * dt.unsqueeze(-1)), blocks(dt), blocks(b), blocks(c)
    cum = (dt * a.float()[:, None, None]).cumsum(-1)  # [H, chunks, chunk]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    y = ((c @ b.transpose(-1, -2)) * decay) @ xdt  # intra-chunk, [H, chunks, chunk, P]
    c_in = c * cum.exp().unsqueeze(-1)
    x_out = xdt * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    end_decay = cum[..., -1].exp()[..., None, None]
    s = state.float()
    for i in range(y.shape[1]):
        y[:, i] += c_in[:, i] @ s.transpose(-1, -2)
        s = s * end_decay[:, i] + x_out[:, i].transpose(-1, -2) @ b[:, i]
    y = y.reshape(y.shape[0], -1, y.shape[-1])[:, :n]
    return y.movedim(0, 1), s


def ssd_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of a batch of seqs: x [bs, H, P]; dt [bs, H]; b, c [bs, H, N];
    state [bs, H, P, N] fp32, updated in place (the caller's gathered copy; no state-sized
    temporaries). Returns y [bs, H, P] (no D skip) and the state."""
    bs, h, p, n = state.shape
    dt = dt.float()
    s = state.view(bs * h, p, n)
    s.mul_((dt * a.float()).exp().reshape(bs * h, 1, 1))
    xdt = (x.float() * dt.unsqueeze(-1)).reshape(bs * h, p, 1)
    s.baddbmm_(xdt, b.float().reshape(bs * h, 1, n))
    return torch.bmm(s, c.float().reshape(bs * h, n, 1)).view(bs, h, p), state


class Mamba2Mixer(nn.Module):
    """in_proj -> [z | xBC | dt]; causal conv + SiLU over xBC; SSD; gated grouped RMSNorm; out_proj.
    Rows are the flattened batch [tokens, hidden]; state moves as the StateBatch says."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, state_size: int, n_groups: int,
                 conv_kernel: int, eps: float, use_conv_bias: bool = True, use_bias: bool = False,
                 dt_min: float = 0.0, dt_max: float = float("inf")) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.state_size, self.n_groups = num_heads, head_dim, state_size, n_groups
        self.inner = num_heads * head_dim
        self.conv_dim = self.inner + 2 * n_groups * state_size
        self.conv_kernel = conv_kernel
        self.in_proj = nn.Linear(hidden_size, self.inner + self.conv_dim + num_heads, bias=use_bias)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim)) if use_conv_bias else None
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = RMSNorm(self.inner, eps, gate="before", groups=n_groups)  # gate, then normalize
        self.out_proj = nn.Linear(self.inner, hidden_size, bias=use_bias)
        # dt is clamped to the config's dt limit (mamba_ssm's dt_limit, default [0, inf)) in
        # prefill and decode alike, so a token's state does not depend on how the step was cut.
        self.dt_min, self.dt_max = dt_min, dt_max
        # Set by the runner: (conv [num_blocks, conv_dim, kernel-1], ssm [num_blocks, H, P, N]).
        self.state_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.conv_dim, self.conv_kernel - 1), (self.num_heads, self.head_dim, self.state_size))

    def forward(self, x: torch.Tensor, sb: StateBatch) -> torch.Tensor:
        n = x.shape[0]
        conv_cache, ssm_cache = self.state_cache
        h, p, ns, gr = self.num_heads, self.head_dim, self.state_size, self.n_groups
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, h], dim=-1)
        decodes, prefills = split_batch(sb)
        xbc = causal_conv(xbc, conv_cache, self.conv_weight, self.conv_bias, decodes, prefills)
        xs, b, c = xbc.split([self.inner, gr * ns, gr * ns], dim=-1)
        xs = xs.view(n, h, p)
        b = b.view(n, gr, ns).repeat_interleave(h // gr, dim=1)
        c = c.view(n, gr, ns).repeat_interleave(h // gr, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(self.dt_min, self.dt_max)
        a = -self.A_log.float().exp()
        y = torch.empty(n, h, p, dtype=torch.float32, device=x.device)
        for wave in decode_waves(decodes):  # a request's draft rows in order
            rows = torch.tensor([s.start for s in wave], device=x.device)
            blocks = torch.tensor([s.running_block for s in wave], device=x.device)
            o, st = ssd_step(xs[rows], dt[rows], a, b[rows], c[rows], gather_states(ssm_cache, blocks))
            y[rows] = o
            ssm_cache.index_copy_(0, blocks, st.to(ssm_cache.dtype))
            for i, s in enumerate(wave):
                for _, dst in save_offsets(s):  # validates n == start_pos + 1
                    ssm_cache[dst] = st[i].to(ssm_cache.dtype)
        for s in prefills:
            st = ssm_cache[s.running_block].float()
            for lo, hi, dsts in segments(s):
                r = slice(s.start + lo, s.start + hi)
                y[r], st = ssd_chunked(xs[r], dt[r], a, b[r], c[r], st)
                for dst in dsts:
                    ssm_cache[dst] = st.to(ssm_cache.dtype)
            ssm_cache[s.running_block] = st.to(ssm_cache.dtype)
        y = y + xs.float() * self.D.float()[:, None]
        o = self.norm(y.view(n, self.inner), z, x.dtype)
        return self.out_proj(o)

    def load_hf(self, name: str, tensor: torch.Tensor) -> str:
        """Copy one HF tensor (name relative to the mixer); returns the parameter it filled."""
        target = {"conv1d.weight": "conv_weight", "conv1d.bias": "conv_bias"}.get(name, name)
        params = dict(self.named_parameters())
        if target not in params:
            raise ValueError(f"unexpected Mamba2 weight {name!r}")
        dst = params[target].data
        src = tensor.reshape(dst.shape) if target == "conv_weight" and tensor.numel() == dst.numel() else tensor
        if dst.shape != src.shape:
            raise ValueError(f"weight {name!r}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
        dst.copy_(src)
        return target

    def hf_param_keys(self) -> set[str]:
        return {n for n, _ in self.named_parameters()}


def tp_slice(name: str, t: torch.Tensor, tp: TPGroup, heads: int, head_dim: int, groups: int,
             state_size: int) -> torch.Tensor:
    """This rank's slice of one HF Mamba2 tensor (`name` relative to the mixer) under tensor
    parallelism: heads split, and with them their groups (B and C rows), so a rank's conv
    channels, grouped norm and SSM state are its heads' only. in_proj rows [z | x | B | C | dt]."""
    h, g = heads, groups
    inner, bc = h * head_dim, g * state_size
    if name in ("in_proj.weight", "in_proj.bias"):
        z, x, b, c, dt = t.split([inner, inner, bc, bc, h], dim=0)
        return torch.cat([part(z, 0, h, tp), part(x, 0, h, tp), part(b, 0, g, tp),
                          part(c, 0, g, tp), part(dt, 0, h, tp)])
    if name in ("conv1d.weight", "conv1d.bias"):  # channels [x | B | C]
        x, b, c = t.split([inner, bc, bc], dim=0)
        return torch.cat([part(x, 0, h, tp), part(b, 0, g, tp), part(c, 0, g, tp)])
    if name == "out_proj.weight":
        return part(t, 1, h, tp)
    if name == "out_proj.bias":
        return bias_once(t, tp)
    return part(t, 0, h, tp)  # dt_bias, A_log, D, the grouped norm's weight [inner]
