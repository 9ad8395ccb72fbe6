"""How the engine spreads over devices and processes.

tensor_parallel_size ranks run one model together (every rank holds 1/N of the weights and of
the KV heads; see loomserve.execution.parallel). The ranks meet at a torch.distributed
rendezvous: master_addr:master_port (port 0 = a free port, single node only). With nnodes > 1
the ranks are split evenly over the nodes; node 0 runs the engine core (rank 0, the driver),
every other node runs `loomserve serve --node-rank K` as headless workers.
data_parallel_size engine cores (each its own scheduler, KV pool and process) serve behind one
front end, which places each request on one core (loomserve.entrypoints.dp_client);
data_parallel_rank is the core's index, set by the front end in each core's copy of the config.
DP x TP: each DP engine core runs its own tensor-parallel group (its own workers and
rendezvous); on CUDA core d's ranks take devices d x TP .. d x TP + TP - 1. DP over several
nodes, and expert parallelism with TP, are refused for now.
decode_context_parallel_size D > 1 (DCP; loomserve.execution.parallel.context_parallel) runs D
ranks that each hold the whole model and 1/D of every sequence's KV (token t on rank
(t // I) % D, I = dcp_kv_cache_interleave_size); accepted with tensor_parallel_size 1 and
data_parallel_size 1 only (world = D). prefill_context_parallel_size P > 1 (PCP;
loomserve.execution.parallel.prefill_context_parallel) runs P ranks that each hold the whole
model and a KV replica and split each step's prefill tokens; accepted alone (world = P).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0  # which DP engine core this config is for (set per core)
    # DEP: MoE experts sharded over the DP ranks, which step in lockstep (dp_lockstep.py);
    # dp_master_port is where the DP ranks' gloo group meets (set by the front end).
    enable_expert_parallel: bool = False
    decode_context_parallel_size: int = 1
    dcp_kv_cache_interleave_size: int = 1  # tokens per rank before the next rank's turn
    prefill_context_parallel_size: int = 1
    dp_master_port: int = 0
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "nnodes",
                     "decode_context_parallel_size", "dcp_kv_cache_interleave_size",
                     "prefill_context_parallel_size"):
            n = getattr(self, name)
            if n < 1:
                raise ValueError(f"{name} must be >= 1, got {n}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank={self.data_parallel_rank} must be in "
                             f"[0, data_parallel_size={self.data_parallel_size})")
        if self.data_parallel_size > 1 and self.nnodes > 1:
            raise ValueError("--data-parallel-size > 1 with --nnodes > 1 is not supported yet "
                             "(DP runs its engine cores, each with its ranks, on one node)")
        if self.data_parallel_size > 1 and self.tensor_parallel_size > 1 and \
                self.enable_expert_parallel:
            raise ValueError("--enable-expert-parallel with --tensor-parallel-size > 1 is not "
                             "supported yet (experts shard over DP ranks of one rank each)")
        self._check_context_parallel()
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.world_size % self.nnodes:
            raise ValueError(f"{self.world_size} ranks do not split evenly over "
                             f"{self.nnodes} nodes")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("--master-port is required with --nnodes > 1")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port={self.master_port} is not a port")

    def _check_context_parallel(self) -> None:
        if self.prefill_context_parallel_size > 1 and (
                self.tensor_parallel_size > 1 or self.data_parallel_size > 1
                or self.decode_context_parallel_size > 1):
            raise ValueError("--prefill-context-parallel-size > 1 is supported alone only (with "
                             "--tensor-parallel-size, --data-parallel-size and "
                             "--decode-context-parallel-size 1: its P ranks each run the whole "
                             "model and split the prefill tokens)")
        if self.decode_context_parallel_size > 1 and (self.tensor_parallel_size > 1
                                                      or self.data_parallel_size > 1):
            raise ValueError("--decode-context-parallel-size > 1 is supported with "
                             "--tensor-parallel-size 1 and --data-parallel-size 1 only (its D "
                             "ranks each run the whole model and hold 1/D of the KV)")

    @property
    def world_size(self) -> int:
        """Ranks of ONE engine core (its tensor-, decode- or prefill-context-parallel group): DP
        engine cores are separate cores, each with its own executor, so they are not counted
        here. At most one of the three sizes exceeds 1 (__post_init__)."""
        return (self.tensor_parallel_size * self.decode_context_parallel_size
                * self.prefill_context_parallel_size)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self) -> range:
        """The global ranks this node runs (rank 0 is the engine core's own process)."""
        n = self.ranks_per_node
        return range(self.node_rank * n, (self.node_rank + 1) * n)
