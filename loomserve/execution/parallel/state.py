"""Process groups of this process's rank: the world, the tensor-parallel group, the step group.

gloo on CPU and NCCL on CUDA for the model's collectives (all-reduce, logit gather); the step
message always travels over a gloo group (it is host bytes, and a worker waits for it for as
long as the engine is idle, so that group's timeout is long while the model group's is short:
a rank that stops answering mid-step fails the step within COLLECTIVE_TIMEOUT_S, never hangs).
A peer process that dies closes its sockets, which gloo reports at once as an error.
Module state: one TPGroup per process (a process is one rank), None until set_layout. Under
decode context parallelism (dcp_size = size) the same group holds the ranks, but they are no
tensor-parallel slices (get_tp() is None then: the model loads whole) unless tp_size = size too
(TP x DCP: the same ranks split the weights and the KV); get_dcp() names it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = float(os.environ.get("LOOMSERVE_COLLECTIVE_TIMEOUT_S", "60"))
IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # how long a worker may wait for the next step


@dataclass
class TPGroup:
    """This rank's place in the tensor-parallel group. Invariant: rank 0 is the driver."""

    rank: int
    size: int
    group: object  # the model group (gloo or NCCL)
    step_group: object  # gloo, for the step message
    dcp_size: int = 1  # > 1: the ranks are decode-context-parallel (split the KV by token)
    pcp_size: int = 1  # > 1: the ranks are prefill-context-parallel, each with the whole model
    tp_size: int = 1  # > 1: the ranks split the weights (= size; with DCP too under TP x DCP)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x (same shape), in rank order, on every rank."""
        out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=self.group)
        return out

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank (same shape everywhere), in place."""
        dist.broadcast(x, src=0, group=self.group)
        return x

    def gather_to_driver(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (same shape) on rank 0, in rank order; None elsewhere."""
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        dist.gather(x, out, dst=0, group=self.group)
        return out


_TP: TPGroup | None = None


def get_tp() -> TPGroup | None:
    """The tensor-parallel group, or None on a single rank (no collective ever runs then) and
    under context parallelism without TP (each rank holds the whole model)."""
    return _TP if _TP is None or _TP.tp_size > 1 else None


def get_group() -> TPGroup | None:
    """This engine core's rank group, whatever kind of parallelism it runs (None: one rank)."""
    return _TP


def get_dcp() -> TPGroup | None:
    """The decode-context-parallel group (every rank of this engine core), or None."""
    return _TP if _TP is not None and _TP.dcp_size > 1 else None


def get_pcp() -> TPGroup | None:
    """The prefill-context-parallel group (every rank of this engine core), or None."""
    return _TP if _TP is not None and _TP.pcp_size > 1 else None


def device_offset(parallel) -> int:
    """The first CUDA device of a DP engine core's ranks: the node's d-th core uses devices
    d x W .. d x W + W - 1 (W its ranks), so the cores of one node never share a GPU."""
    return (parallel.data_parallel_rank % parallel.dp_local_size) * parallel.world_size


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def set_layout(rank: int, world_size: int, device: torch.device, dcp_size: int = 1,
               pcp_size: int = 1, device_offset: int = 0, tp_size: int | None = None) -> TPGroup:
    """This process's rank, known before the rendezvous so the model can load its slice while
    the other ranks start (the groups are filled in by init_distributed, before any step).
    dcp_size / pcp_size: world_size when the ranks are decode- / prefill-context-parallel.
    device_offset: the first CUDA device of this engine core's ranks (a DP core's index x its
    world size; see cuda_device_for)."""
    global _TP
    if device.type == "cuda":
        torch.cuda.set_device((device_offset + rank) % torch.cuda.device_count())
    if tp_size is None:  # the ranks split the weights unless they are context-parallel only
        tp_size = world_size if dcp_size == 1 and pcp_size == 1 else 1
    _TP = TPGroup(rank, world_size, None, None, dcp_size, pcp_size, tp_size)
    return _TP


def master_store(addr: str, port: int, world_size: int | None = None) -> dist.TCPStore:
    """A rendezvous store listening from now on (port 0: the OS picks one, read it back from
    .port), made by the process that outlives the ranks' start (rank 0 before it spawns the
    others; the front end for the DP cores' group). A port only looked up as free can be taken
    by any socket in the seconds a model load lasts (seen: EADDRINUSE under load with two DP
    cores starting at once)."""
    return dist.TCPStore(addr, port, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def init_distributed(master_addr: str, master_port: int, device: torch.device,
                     store: dist.Store | None = None) -> TPGroup:
    """Join the rendezvous as set_layout's rank (blocks until every rank arrived, at most
    COLLECTIVE_TIMEOUT_S); rank 0 passes its master_store, the others connect to it."""
    tp = _TP
    if store is None:
        store = dist.TCPStore(master_addr, master_port, tp.size, is_master=False,
                              timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    dist.init_process_group(backend_for(device), store=dist.PrefixStore("loomserve", store),
                            rank=tp.rank, world_size=tp.size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    tp.group = dist.group.WORLD
    tp.step_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=IDLE_TIMEOUT_S))
    return tp


def destroy_distributed() -> None:
    global _TP
    _TP = None
    if dist.is_initialized():
        dist.destroy_process_group()

