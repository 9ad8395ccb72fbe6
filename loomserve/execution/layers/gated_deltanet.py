"""Gated DeltaNet (Qwen3-Next's linear attention) over per-request state pages, plus the state
plumbing it shares with the Mamba2 mixer.

Per value head the layer keeps a [k_dim, v_dim] matrix S and, per token, forgets (alpha = exp(g))
then writes with the delta rule at rate beta:

    S_t = alpha_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - alpha_t S_{t-1}^T k_t),   o_t = S_t^T q_t

Decode seqs run that step once, vectorized over all of them. A prefill chunk runs the chunked
(WY/UT) form: inside a chunk of C tokens with gamma_t = prod_{s<=t} alpha_s,

    (I + A) U = beta V - beta gamma K S_0,     A[t, s] = beta_t (gamma_t / gamma_s) k_t.k_s  (s < t)

is one unit-lower-triangular solve; then o = gamma Q S_0 + ((Q K^T) o decay) U and the chunk's end
state is gamma_C S_0 + (K gamma_C / gamma)^T U. Decay ratios gamma_t / gamma_s (t >= s) are <= 1
and are always formed as exp of a log difference, so nothing overflows however fast a head forgets.

State (LinearStateSpec.state_shapes of one layer): the causal conv's last kernel-1 inputs
[conv_dim, kernel - 1] and S [v_heads, k_dim, v_dim], both fp32 in the page whatever the model
dtype (bf16 recurrent state drifts over long contexts).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.layers.norm import RMSNorm
from loomserve.execution.layers.state import StateBatch, StateSeq
from loomserve.execution.parallel.state import TPGroup
from loomserve.execution.parallel.tensor_parallel import part

CHUNK = 64


# --- state plumbing shared with mamba2.py ----------------------------------------------------------

def split_batch(sb: StateBatch) -> tuple[list[StateSeq], list[StateSeq]]:
    decodes = [s for s in sb.seqs if s.is_decode]
    prefills = [s for s in sb.seqs if not s.is_decode]
    return decodes, prefills


def decode_waves(decodes: list[StateSeq]) -> list[list[StateSeq]]:
    """Decode rows in waves of distinct running pages, each page's rows in batch order. A
    request verifying drafts has one row per token on the same page (speculative decoding):
    row i must see the state after rows 0..i-1, so wave i holds every request's row i and runs
    after wave i-1 wrote the pages back. Without drafts: one wave, the rows as given."""
    if len({s.running_block for s in decodes}) == len(decodes):
        return [decodes] if decodes else []
    waves: list[list[StateSeq]] = []
    seen: dict[int, int] = {}
    for s in decodes:
        i = seen.get(s.running_block, 0)
        seen[s.running_block] = i + 1
        if i == len(waves):
            waves.append([])
        waves[i].append(s)
    return waves


def save_offsets(s: StateSeq) -> list[tuple[int, int]]:
    """(tokens of this chunk consumed, dst page) for each save, in order."""
    out = []
    for n, dst in sorted(s.saves):
        j = n - s.start_pos
        if not 0 < j <= s.end - s.start:
            raise ValueError(f"save at {n} tokens is outside the chunk starting at {s.start_pos} "
                             f"with {s.end - s.start} tokens")
        out.append((j, dst))
    return out


def segments(s: StateSeq) -> list[tuple[int, int, list[int]]]:
    """The chunk cut at its save points: (first row, end row, pages to save the state into at end)."""
    cuts: dict[int, list[int]] = {}
    for j, dst in save_offsets(s):
        cuts.setdefault(j, []).append(dst)
    out, prev, n = [], 0, s.end - s.start
    for j in sorted(cuts):
        out.append((prev, j, cuts[j]))
        prev = j
    if prev < n:
        out.append((prev, n, []))
    return out


_WORKSPACE: dict[tuple, torch.Tensor] = {}


def gather_states(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks] as fp32, in a buffer reused across layers and steps: a decode batch's
    recurrent states are tens of MB, and a fresh tensor of that size per layer page-faults more
    than the update costs (layers run one after another, so one buffer per shape serves all)."""
    n, tail = blocks.numel(), tuple(cache.shape[1:])
    key = (tail, cache.device)
    ws = _WORKSPACE.get(key)
    if ws is None or ws.shape[0] < n:
        ws = _WORKSPACE[key] = torch.empty((max(n, 2 * (ws.shape[0] if ws is not None else 0)), *tail),
                                           dtype=torch.float32, device=cache.device)
    if cache.dtype == torch.float32:
        return torch.index_select(cache, 0, blocks, out=ws[:n])
    return ws[:n].copy_(cache.index_select(0, blocks))


def causal_conv(x: torch.Tensor, cache: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                decodes: list[StateSeq], prefills: list[StateSeq]) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU over the flattened rows, carrying each seq's last kernel-1
    inputs in `cache` [num_blocks, channels, kernel - 1]. x: [tokens, channels]; weight:
    [channels, kernel]. Writes saves and the final window of every seq."""
    out = torch.empty_like(x)
    width = weight.shape[1] - 1
    w = weight.to(x.dtype)
    for wave in decode_waves(decodes):
        rows = torch.tensor([s.start for s in wave], device=x.device)
        blocks = torch.tensor([s.running_block for s in wave], device=x.device)
        window = torch.cat([cache[blocks].to(x.dtype), x[rows].unsqueeze(-1)], dim=-1)  # [d, C, K]
        y = (window * w).sum(-1)
        if bias is not None:
            y = y + bias
        out[rows] = F.silu(y)
        cache[blocks] = window[..., 1:].to(cache.dtype)
        for i, s in enumerate(wave):
            for _, dst in save_offsets(s):  # validates n == start_pos + 1
                cache[dst] = window[i, :, 1:].to(cache.dtype)
    for s in prefills:
        n = s.end - s.start
        seq = torch.cat([cache[s.running_block].to(x.dtype), x[s.start:s.end].t()], dim=-1)
        y = F.conv1d(seq.unsqueeze(0), w.unsqueeze(1), bias, groups=w.shape[0])[0]  # [C, n]
        out[s.start:s.end] = F.silu(y).t()
        for j, dst in save_offsets(s):
            cache[dst] = seq[:, j:j + width].to(cache.dtype)
        cache[s.running_block] = seq[:, n:n + width].to(cache.dtype)
    return out


# --- the gated delta rule --------------------------------------------------------------------------

def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor,
                           chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. q, k: [len, heads, k_dim] (normalized, q scaled); v: [len, heads, v_dim];
    g (log decay, <= 0), beta: [len, heads]; state: [heads, k_dim, v_dim] fp32.
    Returns o [len, heads, v_dim] and the state after the last token (all fp32)."""
    n = q.shape[0]
    pad = (-n) % chunk

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [len, H, ...] -> [H, chunks, chunk, ...]
        t = t.float().movedim(0, 1)
        if pad:
            t = F.pad(t, (0, 0, 0, pad) if t.dim() == 3 else (0, pad))
        return t.reshape(t.shape[0], -1, chunk, *t.shape[2:])

    # Padding has g = 0 and beta = k = 0: it neither decays nor writes the state.
    q, k, v, g, beta = blocks(q), blocks(k), blocks(v), blocks(g), blocks(beta)
    cum = g.cumsum(-1)  # log gamma_t within each chunk
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta.unsqueeze(-1)
    a = (kb @ k.transpose(-1, -2)) * decay  # diagonal ignored: the solve is unitriangular
    u_v = torch.linalg.solve_triangular(a, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(a, kb * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay
    q_in = q * cum.exp().unsqueeze(-1)  # reads of the chunk's start state
    k_out = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # writes carried to the chunk's end
    end_decay = cum[..., -1].exp()[..., None, None]  # [H, chunks, 1, 1]
    out = torch.empty_like(u_v)
    s = state.float()
    for c in range(q.shape[1]):
        u = u_v[:, c] - w_k[:, c] @ s
        out[:, c] = q_in[:, c] @ s + qk[:, c] @ u
        s = s * end_decay[:, c] + k_out[:, c].transpose(-1, -2) @ u
    out = out.reshape(out.shape[0], -1, out.shape[-1])[:, :n]
    return out.movedim(0, 1), s


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of a batch of seqs: q, k [b, heads, k_dim]; v [b, heads, v_dim];
    beta [b, heads]; g [b, heads] (one decay per head) or [b, heads, k_dim] (per key channel:
    Kimi Delta Attention); state [b, heads, k_dim, v_dim] fp32, updated in place (the caller's
    gathered copy: a state is MBs per seq, and fresh temporaries of that size cost more in page
    faults than the arithmetic). Returns o [b, heads, v_dim] and the state."""
    b, h, dk, dv = state.shape
    q, k = q.float().reshape(b * h, 1, dk), k.float().reshape(b * h, 1, dk)
    s = state.view(b * h, dk, dv)
    s.mul_(g.float().exp().reshape(b * h, -1, 1))
    u = (v.float().reshape(b * h, 1, dv) - torch.bmm(k, s)) * beta.float().reshape(b * h, 1, 1)
    s.baddbmm_(k.transpose(1, 2), u)
    return torch.bmm(q, s).view(b, h, dv), state


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, rec_cache: torch.Tensor, decodes: list[StateSeq],
               prefills: list[StateSeq], chunk_rule=chunk_gated_delta_rule) -> torch.Tensor:
    """The gated delta rule over a step's rows (q, k [tokens, heads, k_dim] normalized, q
    scaled; v [tokens, heads, v_dim]; g, beta as the step and chunk forms take them): decodes
    in one vectorized step, each prefill chunk by `chunk_rule` cut at its saves. Reads and
    writes each seq's recurrent state in rec_cache [num_blocks, heads, k_dim, v_dim] (running
    page and checkpoints). Returns the core output [tokens, heads, v_dim] fp32."""
    core = torch.empty(*v.shape, dtype=torch.float32, device=v.device)
    for wave in decode_waves(decodes):
        rows = torch.tensor([s.start for s in wave], device=v.device)
        blocks = torch.tensor([s.running_block for s in wave], device=v.device)
        o, st = recurrent_gated_delta_step(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                           gather_states(rec_cache, blocks))
        core[rows] = o
        rec_cache.index_copy_(0, blocks, st.to(rec_cache.dtype))
        for i, s in enumerate(wave):
            for _, dst in save_offsets(s):  # validates n == start_pos + 1
                rec_cache[dst] = st[i].to(rec_cache.dtype)
    for s in prefills:
        st = rec_cache[s.running_block].float()
        for lo, hi, dsts in segments(s):
            r = slice(s.start + lo, s.start + hi)
            core[r], st = chunk_rule(q[r], k[r], v[r], g[r], beta[r], st)
            for dst in dsts:
                rec_cache[dst] = st.to(rec_cache.dtype)
        rec_cache[s.running_block] = st.to(rec_cache.dtype)
    return core


class GatedDeltaNet(nn.Module):
    """Qwen3-Next / Qwen3.5 linear attention on flattened rows [tokens, hidden] with a StateBatch.

    in_proj holds [q | k | v | z | b | a], so the conv input is one contiguous slice. Two HF
    layouts fill it: Qwen3-Next's in_proj_qkvz and in_proj_ba, regrouped at load from their
    per-key-head interleave, or (split_projections, Qwen3.5) in_proj_qkv, in_proj_z, in_proj_b
    and in_proj_a, already in that order."""

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, k_dim: int,
                 v_dim: int, conv_kernel: int, eps: float, split_projections: bool = False) -> None:
        super().__init__()
        self.split_projections = split_projections
        self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim = num_k_heads, num_v_heads, k_dim, v_dim
        self.key_size, self.value_size = num_k_heads * k_dim, num_v_heads * v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.conv_kernel = conv_kernel
        self.in_proj = nn.Linear(hidden_size, self.conv_dim + self.value_size + 2 * num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = RMSNorm(v_dim, eps, gate="after")  # normalize each head's values, then gate
        self.out_proj = nn.Linear(self.value_size, hidden_size, bias=False)
        # Set by the runner: (conv [num_blocks, conv_dim, kernel-1], recurrent [num_blocks, Hv, Dk, Dv]).
        self.state_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.k_dim, self.v_dim))

    def forward(self, x: torch.Tensor, sb: StateBatch) -> torch.Tensor:
        n = x.shape[0]
        conv_cache, rec_cache = self.state_cache
        hv = self.num_v_heads
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_size, hv, hv], dim=-1)
        decodes, prefills = split_batch(sb)
        mixed = causal_conv(mixed, conv_cache, self.conv_weight, None, decodes, prefills)
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        rep = hv // self.num_k_heads
        q = l2norm(q.float().view(n, self.num_k_heads, self.k_dim)) * self.k_dim ** -0.5
        k = l2norm(k.float().view(n, self.num_k_heads, self.k_dim))
        if rep > 1:  # each key head serves `rep` consecutive value heads
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        v = v.view(n, hv, self.v_dim)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        core = delta_rule(q, k, v, g, beta, rec_cache, decodes, prefills)
        o = self.norm(core, z.view(n, hv, self.v_dim), x.dtype)
        return self.out_proj(o.reshape(n, self.value_size))

    # --- HF weights -------------------------------------------------------------------------------

    def load_hf(self, name: str, tensor: torch.Tensor) -> str:
        """Copy one HF tensor (name relative to the layer, e.g. 'in_proj_qkvz.weight'); returns
        the parameter it filled, for the loader's coverage check."""
        hk, rep, dk, dv = self.num_k_heads, self.num_v_heads // self.num_k_heads, self.k_dim, self.v_dim
        w = self.in_proj.weight.data
        split = _SPLIT_ROWS.get(name)
        if split is not None and self.split_projections:  # Qwen3.5: rows already [q|k|v], z, b, a
            offsets = {"qkv": 0, "z": self.conv_dim, "b": self.conv_dim + self.value_size,
                       "a": self.conv_dim + self.value_size + self.num_v_heads}
            rows = {"qkv": self.conv_dim, "z": self.value_size}.get(split, self.num_v_heads)
            _copy(w.narrow(0, offsets[split], rows), tensor, name)
            return f"in_proj.weight#{split}"
        fused = name in ("in_proj_qkvz.weight", "in_proj_ba.weight")
        if split is not None or (fused and self.split_projections):
            reads = "in_proj_qkv/z/b/a" if self.split_projections else "in_proj_qkvz/ba"
            raise ValueError(f"unexpected Gated DeltaNet weight {name!r} (this layer reads {reads})")
        if name == "in_proj_qkvz.weight":
            t = tensor.view(hk, 2 * dk + 2 * rep * dv, -1)
            q, k, v, z = t.split([dk, dk, rep * dv, rep * dv], dim=1)
            ks, vs = self.key_size, self.value_size
            for part, off in ((q, 0), (k, ks), (v, 2 * ks), (z, 2 * ks + vs)):
                _copy(w.narrow(0, off, part.shape[0] * part.shape[1]), part.reshape(-1, t.shape[-1]), name)
            return "in_proj.weight#qkvz"
        if name == "in_proj_ba.weight":
            t = tensor.view(hk, 2 * rep, -1)
            b, a = t.split([rep, rep], dim=1)
            off = self.conv_dim + self.value_size
            _copy(w.narrow(0, off, self.num_v_heads), b.reshape(-1, t.shape[-1]), name)
            _copy(w.narrow(0, off + self.num_v_heads, self.num_v_heads), a.reshape(-1, t.shape[-1]), name)
            return "in_proj.weight#ba"
        if name == "conv1d.weight":
            _copy(self.conv_weight.data, tensor.reshape(self.conv_dim, -1), name)
            return "conv_weight"
        params = dict(self.named_parameters())
        if name not in params:
            raise ValueError(f"unexpected Gated DeltaNet weight {name!r}")
        _copy(params[name].data, tensor, name)
        return name

    def hf_param_keys(self) -> set[str]:
        keys = {n for n, _ in self.named_parameters()} - {"in_proj.weight"}
        parts = ("qkv", "z", "b", "a") if self.split_projections else ("qkvz", "ba")
        return keys | {f"in_proj.weight#{p}" for p in parts}


# Qwen3.5's separate input projections -> their part of in_proj.
_SPLIT_ROWS = {"in_proj_qkv.weight": "qkv", "in_proj_z.weight": "z", "in_proj_b.weight": "b",
               "in_proj_a.weight": "a"}


def tp_slice(name: str, t: torch.Tensor, tp: TPGroup, key_heads: int, value_heads: int,
             key_head_dim: int, value_head_dim: int) -> torch.Tensor:
    """This rank's slice of one HF Gated DeltaNet tensor (`name` relative to the layer) under
    tensor parallelism: key heads split with the value heads they serve, so a rank's conv
    channels, decay and recurrent state are its heads' only. HF's fused projections are grouped
    per key head, so a rank's key heads are one contiguous slice of the per-key-head view;
    Qwen3.5's separate ones are [q | k | v] (as the conv channels), z, b and a."""
    hk, hv = key_heads, value_heads
    if name in ("in_proj_qkvz.weight", "in_proj_ba.weight"):
        return part(t.view(hk, -1, t.shape[-1]), 0, hk, tp).reshape(-1, t.shape[-1])
    if name in ("conv1d.weight", "in_proj_qkv.weight"):  # rows [q (hk*dk) | k (hk*dk) | v (hv*dv)]
        ks, vs = hk * key_head_dim, hv * value_head_dim
        q, k, v = t.split([ks, ks, vs], dim=0)
        return torch.cat([part(q, 0, hk, tp), part(k, 0, hk, tp), part(v, 0, hv, tp)])
    if name in ("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"):  # by value head
        return part(t, 0, hv, tp)
    if name in ("dt_bias", "A_log"):
        return part(t, 0, hv, tp)
    if name == "out_proj.weight":
        return part(t, 1, hv, tp)
    return t  # the per-head norm


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name!r}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)
