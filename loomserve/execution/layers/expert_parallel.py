"""Routed experts, run locally or sharded over the DP ranks (DEP), for every MoE block.

A block mixes in ExpertParallel and declares: `expert_params` (names, dotted for a child
module, of its stacked per-expert parameters, each [experts, ...]), `expert(e, rows)` (local
expert e on rows [n, width], unweighted) and `top_k`; `routed_width` when the width is not
dim 1 of its `experts_down` ([experts, width, inter]); `acc_fp32` when the
reference sums the experts' outputs in fp32 (Nemotron-H); `expert_act` when its expert is
one layers/grouped_experts.py runs: "swiglu" (expert_params are gate_up [experts, 2 * inter,
width], gate rows then up, and down [experts, width, inter]) or "relu2" (up [experts, inter,
width] and down). `run_experts(x, weights, ids)` then sums the top-k experts'
weighted outputs per token ([tokens, width], weights [tokens, k]).

Local experts: such a block runs them as one grouped call (layers/grouped_experts.py: pairs
sorted by expert, one C kernel call on the CPU, torch._grouped_mm on Hopper bf16) wherever its
stacks allow; other blocks, devices and dtypes loop over the routed experts calling expert().

Expert parallelism (`--enable-expert-parallel` with data parallelism): enable_ep() keeps only
this rank's contiguous slice of every stacked parameter (experts / ranks each). Each MoE forward
then runs, over the DP ranks' gloo group, a true all-to-all: the (token, expert) pairs go to the
rank holding the expert (one row of width + 2 floats each; an all-to-all of the counts first),
that rank runs its experts on them, and the weighted outputs come back (width floats per pair)
to be summed per token. Per layer each rank moves top_k x its tokens x (2 x width + 2) floats in
all, whatever the number of ranks. Every rank must call run_experts once per MoE layer per step,
in the same order: a rank without work calls ep_dummy(). Reduction order differs from one rank
(partial sums per rank), so outputs match within fp rounding. Counters (ep_calls, ep_pairs,
ep_bytes: pairs routed and bytes sent off-rank) feed the lockstep driver and dep_comm.py.
"""

from __future__ import annotations

import torch
from torch import nn

from loomserve.execution.layers import grouped_experts


class ExpertParallel:
    expert_params: tuple[str, ...] = ()
    expert_act: str | None = None  # grouped_experts.ACTS key when expert() is one of those
    acc_fp32 = False
    ep = None  # (group, rank, size, first local expert) once enable_ep() ran
    ep_calls = ep_pairs = ep_bytes = 0

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _stacked(self, name: str) -> tuple[nn.Module, str, torch.Tensor]:
        owner, _, attr = name.rpartition(".")
        module = self.get_submodule(owner) if owner else self
        return module, attr, getattr(module, attr)

    @property
    def routed_width(self) -> int:
        """The width of the rows the experts take and return (ep_dummy's empty batch)."""
        return self.experts_down.shape[1]

    @property
    def local_experts(self) -> int:
        return self._stacked(self.expert_params[0])[2].shape[0]

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.ep is not None:
            return self._ep_routed(x, weights, ids)
        return self._local(x, weights, ids, 0, self.local_experts)

    def _local(self, x, weights, ids, first: int, count: int) -> torch.Tensor:
        """Experts [first, first + count) over x (rows routed to other experts add 0): grouped
        where the block and its stacks allow, else the loop."""
        if self.expert_act is not None:
            w1, w2 = (self._stacked(name)[2] for name in self.expert_params[:2])
            if w1.shape[0] == count and grouped_experts.usable(self.expert_act, w1, w2,
                                                               ids.numel()):
                y = grouped_experts.run(x, weights, ids, self.expert_act, w1, w2, first)
                return y if self.acc_fp32 else y.to(x.dtype)
        return self._loop(x, weights, ids, first, count)

    def _loop(self, x, weights, ids, first: int, count: int) -> torch.Tensor:
        """_local as one expert() call per routed expert."""
        acc = torch.zeros(x.shape, dtype=torch.float32 if self.acc_fp32 else x.dtype,
                          device=x.device)
        for e in torch.unique(ids).tolist():
            if not first <= e < first + count:
                continue
            tok, slot = torch.where(ids == e)
            y = self.expert(e - first, x[tok])
            if self.acc_fp32:
                acc.index_add_(0, tok, y.float() * weights[tok, slot, None].float())
            else:
                acc.index_add_(0, tok, (y * weights[tok, slot, None]).to(acc.dtype))
        return acc

    # -- expert parallelism ------------------------------------------------------------------
    def enable_ep(self, group, rank: int, size: int) -> None:
        """Keep only experts [rank * E / size, (rank + 1) * E / size) of every stacked param."""
        total = self.local_experts
        if total % size:
            raise ValueError(f"expert parallel: {total} experts do not split over {size} ranks")
        per = total // size
        first = rank * per
        for name in self.expert_params:
            module, attr, p = self._stacked(name)
            setattr(module, attr, nn.Parameter(p.data[first:first + per].clone(),
                                               requires_grad=False))
        self.ep = (group, rank, size, first)
        self.ep_calls = self.ep_pairs = self.ep_bytes = 0

    def ep_dummy(self, dtype: torch.dtype, device) -> None:
        """This layer's collectives with no tokens (a rank without work this step)."""
        x = torch.zeros(0, self.routed_width, dtype=dtype, device=device)
        k = self.top_k
        self._ep_routed(x, torch.zeros(0, k), torch.zeros(0, k, dtype=torch.long))

    def _ep_routed(self, x, weights, ids) -> torch.Tensor:
        """Dispatch each (token, expert) pair to the rank holding the expert, run the local
        experts on what arrived, send the weighted outputs back and sum them per token: two
        all-to-alls of pairs (plus one of counts). gloo buffers live on the CPU; the experts
        run on x's device."""
        import torch.distributed as dist
        group, rank, size, first = self.ep
        self.ep_calls += 1
        n, width, k = x.shape[0], x.shape[1], ids.shape[1]
        per = self.local_experts
        flat = ids.reshape(-1).cpu()
        dest = torch.div(flat, per, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)  # pairs grouped by destination rank
        tok = torch.div(order, k, rounding_mode="floor")
        sent = torch.bincount(dest, minlength=size)
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent, group=group)
        # One row per pair: input | routing weight | expert id.
        packed = torch.empty(len(order), width + 2, dtype=torch.float32)
        packed[:, :width] = x.detach().float().cpu()[tok]
        packed[:, width] = weights.reshape(-1).float().cpu()[order]
        packed[:, width + 1] = flat[order].float()
        recv = torch.empty(int(got.sum()), width + 2, dtype=torch.float32)
        dist.all_to_all_single(recv, packed, got.tolist(), sent.tolist(), group=group)
        r = recv.to(x.device)
        y = self._local(r[:, :width].to(x.dtype), r[:, width:width + 1],
                        r[:, width + 1:].long(), first, per).float().cpu()
        back = torch.empty(len(order), width, dtype=torch.float32)
        dist.all_to_all_single(back, y, sent.tolist(), got.tolist(), group=group)
        # Bytes this rank sent to the other ranks (its own share stays put): pair rows out,
        # output rows back, and the counts.
        off_out, off_back = len(order) - int(sent[rank]), int(got.sum()) - int(got[rank])
        self.ep_pairs += len(order)
        self.ep_bytes += 4 * (off_out * (width + 2) + off_back * width) + 8 * (size - 1)
        out = torch.zeros(n, width, dtype=torch.float32)
        out.index_add_(0, tok, back)
        return out.to(device=x.device,
                      dtype=torch.float32 if self.acc_fp32 else x.dtype)
