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
as grouped products (layers/grouped_experts.py: the step's pairs sorted by expert, one C call on
the CPU), or as a loop over the routed experts where the grouped op does not apply.

Expert parallelism (DEP): loomserve.execution.layers.expert_parallel (the mixin).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.layers.expert_parallel import ExpertParallel
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


class DeepseekMoE(ExpertParallel, nn.Module):
    """Routed SwiGLU experts + shared SwiGLU experts (one MLP n_shared times as wide)."""

    expert_params = ("experts_gate_up", "experts_down")
    expert_act = "swiglu"  # grouped products (layers/grouped_experts.py)

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, n_group: int,
                 topk_group: int, norm_topk_prob: bool, scale: float, n_shared: int) -> None:
        super().__init__()
        self.gate = GroupLimitedRouter(hidden, experts, top_k, n_group, topk_group, norm_topk_prob, scale)
        self.experts_gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(experts, hidden, inter))
        self.inter, self.num_experts = inter, experts  # num_experts: the checkpoint's (loading)
        self.shared_experts = SwiGLU(hidden, inter * n_shared) if n_shared else None

    @property
    def top_k(self) -> int:
        return self.gate.top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.run_experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, self.experts_gate_up[e]).split(self.inter, dim=-1)
        return F.linear(F.silu(gate) * up, self.experts_down[e])

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
