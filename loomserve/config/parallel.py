"""How the engine spreads over devices and processes.

tensor_parallel_size ranks run one model together (every rank holds 1/N of the weights and of
the KV heads; see loomserve.execution.parallel). The ranks meet at a torch.distributed
rendezvous: master_addr:master_port (port 0 = a free port, single node only). With nnodes > 1
the ranks are split evenly over the nodes; node 0 runs the engine core (rank 0, the driver),
every other node runs `loomserve serve --node-rank K` as headless workers.
data_parallel_size engine cores (each its own scheduler, KV pool and process) serve behind one
front end, which places each request on one core (loomserve.engine.dp_client);
data_parallel_rank is the core's index, set by the front end in each core's copy of the config.
DP x TP: each DP engine core runs its own tensor-parallel group (its own workers and
rendezvous); on CUDA a node's d-th core's ranks take its devices d x TP .. d x TP + TP - 1.
DP over nodes (nnodes > 1 with data_parallel_size > 1): the D cores split evenly over the nodes
(node k runs cores k x D/N .. (k+1) x D/N - 1, each core's TP group inside its node); node 0
runs the front end and binds two ZMQ sockets per remote core at master_addr, on ports
master_port + 1 + 2r and master_port + 2 + 2r (r the core's DP rank); DEP's group meets at
master_addr:master_port. Nodes > 0 run `loomserve serve --node-rank K` headless
(loomserve.engine.dp_remote). Expert parallelism with TP is refused for now.
decode_context_parallel_size D > 1 (DCP; loomserve.execution.parallel.context_parallel) runs D
ranks that each hold 1/D of every sequence's KV (token t on rank (t // I) % D, I =
dcp_kv_cache_interleave_size): with tensor_parallel_size 1 each rank holds the whole model
(world = D); with tensor_parallel_size D (MLA models) the TP ranks split the KV too (world =
D, as vLLM's -tp 8 -dcp 8); under DP each engine core has its own D ranks. prefill_context_parallel_size P > 1 (PCP;
loomserve.execution.parallel.prefill_context_parallel) runs P ranks that each hold the whole
model and a KV replica and split each step's prefill tokens; with TP and DCP 1 (world = P; under DP each engine core has its own P ranks).
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
    # Set by the executor, not by users: a memfd holding every rank's KV pool (KV tiers with
    # tensor or decode context parallelism on CPU; loomserve.execution.parallel.shared_pool).
    shared_kv_fd: int | None = None

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
        if self.data_parallel_size > 1 and self.data_parallel_size % self.nnodes:
            raise ValueError(f"--data-parallel-size {self.data_parallel_size} does not split "
                             f"evenly over {self.nnodes} nodes (each node runs D / N engine cores)")
        if self.data_parallel_size > 1 and self.tensor_parallel_size > 1 and \
                self.enable_expert_parallel:
            raise ValueError("--enable-expert-parallel with --tensor-parallel-size > 1 is not "
                             "supported yet (experts shard over DP ranks of one rank each)")
        self._check_context_parallel()
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.data_parallel_size == 1 and self.world_size % self.nnodes:
            raise ValueError(f"{self.world_size} ranks do not split evenly over "
                             f"{self.nnodes} nodes")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("--master-port is required with --nnodes > 1")
        top = self.master_port + (2 * self.data_parallel_size if self.nnodes > 1 else 0)
        if not 0 <= self.master_port <= top < 65536:
            raise ValueError(f"master_port={self.master_port} is not a port (multi-node DP also "
                             f"uses the {2 * self.data_parallel_size} ports above it)")

    def _check_context_parallel(self) -> None:
        if self.prefill_context_parallel_size > 1 and (
                self.tensor_parallel_size > 1 or self.decode_context_parallel_size > 1):
            raise ValueError("--prefill-context-parallel-size > 1 is supported with "
                             "--tensor-parallel-size and --decode-context-parallel-size 1 (its "
                             "P ranks each run the whole model and split the prefill tokens; "
                             "with --data-parallel-size each engine core has its own P ranks)")
        d, t = self.decode_context_parallel_size, self.tensor_parallel_size
        if d > 1 and t not in (1, d):
            raise ValueError("--decode-context-parallel-size D > 1 is supported with "
                             "--tensor-parallel-size 1 (D ranks that each run the whole model "
                             "and hold 1/D of the KV) or --tensor-parallel-size D (the TP ranks "
                             "also split the KV by token: MLA models, whose latent cache TP "
                             "would replicate); with --data-parallel-size each engine core has "
                             "its own D ranks")
        if self.enable_expert_parallel and self.data_parallel_size > 1 and self.world_size > 1:
            raise ValueError("--enable-expert-parallel with a context-parallel group per engine "
                             "core is not supported yet (experts shard over DP ranks of one "
                             "rank each)")

    @property
    def world_size(self) -> int:
        """Ranks of ONE engine core (its tensor-, decode- or prefill-context-parallel group): DP
        engine cores are separate cores, each with its own executor, so they are not counted
        here. At most one of the three sizes exceeds 1, except TP x DCP with DCP = TP (the same
        ranks split the weights and the KV's tokens; __post_init__)."""
        return (max(self.tensor_parallel_size, self.decode_context_parallel_size)
                * self.prefill_context_parallel_size)

    @property
    def ranks_per_node(self) -> int:
        """One engine core's ranks on this node (a DP core's group never spans nodes)."""
        return self.world_size if self.data_parallel_size > 1 else self.world_size // self.nnodes

    def node_ranks(self) -> range:
        """The global ranks of one engine core this node runs (rank 0: the core's process)."""
        if self.data_parallel_size > 1:
            return range(self.world_size)
        n = self.ranks_per_node
        return range(self.node_rank * n, (self.node_rank + 1) * n)

    @property
    def dp_local_size(self) -> int:
        """Engine cores per node (one engine core, on node 0, without DP)."""
        return self.data_parallel_size // self.nnodes if self.data_parallel_size > 1 else 1

    def dp_node_ranks(self, node: int | None = None) -> range:
        """The DP engine cores a node runs (this one by default)."""
        k, n = self.node_rank if node is None else node, self.dp_local_size
        return range(k * n, (k + 1) * n)

    def tp_rendezvous(self) -> tuple[str, int]:
        """Where one core's ranks meet (port 0: pick a free one): master_addr:master_port when
        they span nodes; a DP core's group is inside its node, so a local free port."""
        if self.data_parallel_size > 1:
            return "127.0.0.1", 0
        return self.master_addr, self.master_port

    def dp_rendezvous(self) -> tuple[str, int]:
        """Where DEP's DP group meets: master_addr:master_port over nodes, else the front end's
        local dp_master_port."""
        if self.nnodes > 1:
            return self.master_addr, self.master_port
        return "127.0.0.1", self.dp_master_port

    def remote_core_ports(self, dp_rank: int) -> tuple[int, int]:
        """Multi-node DP: (inputs, events) ports node 0 binds for core dp_rank at master_addr."""
        return self.master_port + 1 + 2 * dp_rank, self.master_port + 2 + 2 * dp_rank
