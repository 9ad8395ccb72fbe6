"""DeepSeek's mixture of experts (V3 / Kimi K2 / GLM-4.5 routing): group-limited sigmoid routing
over SwiGLU experts, plus always-on shared experts.

Routing, as transformers' DeepseekV3TopkRouter does it (all in fp32):
- scores = sigmoid(x @ W_gate^T); the *choice* adds e_score_correction_bias (the load-balancing
  bias learned without an auxiliary loss), the *weights* do not;
- group limit: experts fall into n_group equal groups, each group scored by the sum of its two
  best choice scores; only the topk_group best groups stay eligible;
- the top_k eligible experts by choice score are picked; their plain scores, normalized to sum
  1 when norm_topk_prob, times routed_scaling_factor, weight the experts' outputs.

Experts are stacked [experts, 2 * inter, hidden] (gate; up) and [experts, hidden, inter] and run
as a loop over the experts the step routes to (no grouped GEMM; correctness first).

Expert parallelism (DEP, `--enable-expert-parallel` with data parallelism): enable_ep() keeps
only this rank's contiguous slice of the experts (experts / ranks each). Each MoE forward then
runs, over the DP ranks' gloo group, a true all-to-all: the (token, expert) pairs go to the rank
holding the expert (one row of hidden + 2 floats each; an all-to-all of the counts first), that
rank runs its experts on them, and the weighted outputs come back (hidden floats per pair) to be
summed per token. Per layer each rank moves top_k x its tokens x (2 x hidden + 2) floats in all,
whatever the number of ranks (the former all-gather / all-reduce form moved every rank's tokens
to every rank). Every rank must call
forward once per MoE layer per step, in the same order: a rank without work calls ep_dummy().
Reduction order differs from one rank (partial sums per rank), so outputs match within fp
rounding.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.layers.mlp import SwiGLU


class GroupLimitedRouter(nn.Module):
    def __init__(self, hidden: int, experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, scale: float) -> None:
        super().__init__()
        if experts % n_group or not 1 <= topk_group <= n_group or top_k > experts // n_group * topk_group:
            raise ValueError(f"routing needs experts ({experts}) divisible by n_group ({n_group}) and "
                             f"top_k ({top_k}) <= experts in topk_group ({topk_group}) groups")
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm, self.scale = norm_topk_prob, scale

    def _apply(self, fn, recurse=True):
        # Routing stays fp32 in a bf16 model, as in the reference (near-tied scores pick experts).
        super()._apply(fn, recurse)
        for p in self.parameters(recurse=False):
            if p.dtype != torch.float32:
                p.data = p.data.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, top_k] fp32, expert ids [tokens, top_k])."""
        scores = F.linear(x.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        n = x.shape[0]
        grouped = choice.view(n, self.n_group, -1)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)  # [tokens, groups]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(self.topk_group, dim=-1)[1], True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, -1)
        ids = choice.topk(self.top_k, dim=-1)[1]
        w = scores.gather(1, ids)
        if self.norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scale, ids


class DeepseekMoE(nn.Module):
    """Routed SwiGLU experts + shared SwiGLU experts (one MLP n_shared times as wide)."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, n_group: int,
                 topk_group: int, norm_topk_prob: bool, scale: float, n_shared: int) -> None:
        super().__init__()
        self.gate = GroupLimitedRouter(hidden, experts, top_k, n_group, topk_group, norm_topk_prob, scale)
        self.experts_gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(experts, hidden, inter))
        self.inter, self.num_experts = inter, experts
        self.shared_experts = SwiGLU(hidden, inter * n_shared) if n_shared else None
        self.ep = None  # (group, rank, size, first local expert) once enable_ep() ran
        self.ep_calls = 0  # forwards (real or dummy) under EP: the lockstep driver checks it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.ep is not None:
            out = self._ep_routed(x, weights, ids)
        else:
            out = self._routed(x, weights, ids, 0, self.num_experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _routed(self, x, weights, ids, first: int, count: int) -> torch.Tensor:
        """The routed experts [first, first + count) over x (rows of other experts add 0)."""
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            if not first <= e < first + count:
                continue
            tok, slot = torch.where(ids == e)
            gate, up = F.linear(x[tok], self.experts_gate_up[e - first]).split(self.inter, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts_down[e - first]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(x.dtype))
        return out

    # -- expert parallelism ------------------------------------------------------------------
    def enable_ep(self, group, rank: int, size: int) -> None:
        """Keep only experts [rank * E / size, (rank + 1) * E / size) of the loaded stacks."""
        if self.num_experts % size:
            raise ValueError(f"expert parallel: {self.num_experts} experts do not split over "
                             f"{size} ranks")
        per = self.num_experts // size
        first = rank * per
        self.experts_gate_up = nn.Parameter(self.experts_gate_up.data[first:first + per].clone(),
                                            requires_grad=False)
        self.experts_down = nn.Parameter(self.experts_down.data[first:first + per].clone(),
                                         requires_grad=False)
        self.ep = (group, rank, size, first)
        self.ep_pairs = self.ep_bytes = 0  # (token, expert) pairs routed; bytes sent off-rank

    def ep_dummy(self, hidden: int, dtype: torch.dtype, device) -> None:
        """This layer's collectives with no tokens (a rank without work this step)."""
        x = torch.zeros(0, hidden, dtype=dtype, device=device)
        k = self.gate.top_k
        self._ep_routed(x, torch.zeros(0, k), torch.zeros(0, k, dtype=torch.long))

    def _ep_routed(self, x, weights, ids) -> torch.Tensor:
        """Dispatch each (token, expert) pair to the rank holding the expert, run the local
        experts on what arrived, send the weighted outputs back and sum them per token: two
        all-to-alls of pairs (plus one of counts). gloo buffers live on the CPU; the experts
        run on x's device."""
        import torch.distributed as dist
        group, _rank, size, first = self.ep
        self.ep_calls += 1
        n, hidden, k = x.shape[0], x.shape[1], ids.shape[1]
        per = self.experts_down.shape[0]
        flat = ids.reshape(-1).cpu()
        dest = torch.div(flat, per, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)  # pairs grouped by destination rank
        tok = torch.div(order, k, rounding_mode="floor")
        sent = torch.bincount(dest, minlength=size)
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent, group=group)
        # One row per pair: hidden | routing weight | expert id.
        packed = torch.empty(len(order), hidden + 2, dtype=torch.float32)
        packed[:, :hidden] = x.detach().float().cpu()[tok]
        packed[:, hidden] = weights.reshape(-1).float().cpu()[order]
        packed[:, hidden + 1] = flat[order].float()
        recv = torch.empty(int(got.sum()), hidden + 2, dtype=torch.float32)
        dist.all_to_all_single(recv, packed, got.tolist(), sent.tolist(), group=group)
        r = recv.to(x.device)
        y = self._routed(r[:, :hidden].to(x.dtype), r[:, hidden:hidden + 1],
                         r[:, hidden + 1:].long(), first, per).float().cpu()
        back = torch.empty(len(order), hidden, dtype=torch.float32)
        dist.all_to_all_single(back, y, sent.tolist(), got.tolist(), group=group)
        # Bytes this rank sent to the other ranks (its own share stays put): pair rows out,
        # output rows back, and the counts (benchmarks/dep_comm.py reads them).
        off_out, off_back = len(order) - int(sent[_rank]), int(got.sum()) - int(got[_rank])
        self.ep_pairs += len(order)
        self.ep_bytes += 4 * (off_out * (hidden + 2) + off_back * hidden) + 8 * (size - 1)
        out = torch.zeros(n, hidden, dtype=torch.float32)
        out.index_add_(0, tok, back)
        return out.to(device=x.device, dtype=x.dtype)

    def load_expert(self, e: int, proj: str, t: torch.Tensor) -> str:
        """One expert's HF gate_proj / up_proj / down_proj weight into the stacks; returns the key
        the loader counts it under."""
        if proj == "down_proj":
            _copy(self.experts_down.data[e], t, proj)
            return f"experts_down#{e}"
        j = 0 if proj == "gate_proj" else 1
        _copy(self.experts_gate_up.data[e].narrow(0, j * self.inter, self.inter), t, proj)
        return f"experts_gate_up#{e}.{j}"

    def expected_keys(self) -> set[str]:
        return ({f"experts_down#{e}" for e in range(self.num_experts)}
                | {f"experts_gate_up#{e}.{j}" for e in range(self.num_experts) for j in (0, 1)})


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"expert weight {name!r}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)
