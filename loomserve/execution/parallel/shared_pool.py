"""One KV pool in shared memory for all ranks of an engine core, so the KV tiers see whole pages.

Under tensor or decode context parallelism each rank holds a shard of every block (its KV heads,
or its tokens). KV tiers (loomserve.kv.connector) live in the engine core, beside rank 0, and
move whole pages between the pool and the tiers on their own threads. On one CPU node the ranks
therefore allocate their pools as slices of ONE buffer in shared memory (a memfd the driver
creates and every worker inherits): block b's logical page is [rank 0's page | rank 1's page |
...], and rank 0's tier connector reads and writes it whole, for every rank at once. The
connector's invariant (a row being loaded or stored is not reused until its handle is done)
holds for every rank's slice of the row, since the ranks run the same steps; a store starts
after the step that filled the block, and every rank wrote its shard before the step's last
collective. A page stored under a layout is only ever loaded under the same one: the tier
fingerprint carries the rank layout (layout_id). Refused where it cannot hold: on CUDA (each
rank's pool is on its own device), across nodes, and under prefill context parallelism (each
rank keeps a whole replica).
"""

from __future__ import annotations

import os

import torch


def create() -> int:
    """A new anonymous shared-memory file (inherited by workers through pass_fds)."""
    return os.memfd_create("loomserve-kv-pool", 0)


def map_pool(fd: int, num_blocks: int, page_bytes: int, index: int, count: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(every rank's pages [num_blocks, count x page_bytes], this rank's slice of them).
    Every rank sizes the file alike; sizing again keeps what is already there (zeros at
    first), so the ranks may map it in any order."""
    total = num_blocks * page_bytes * count
    if os.fstat(fd).st_size != total:
        os.ftruncate(fd, total)
    full = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=total, dtype=torch.uint8)
    full = full.view(num_blocks, count * page_bytes)
    return full, full[:, index * page_bytes:(index + 1) * page_bytes]


def check_supported(config) -> None:
    """KV tiers with > 1 rank per engine core: where the shared pool can serve them."""
    pc = config.parallel
    why = None
    if config.model.torch_device.type != "cpu":
        why = "on CUDA (each rank's KV pool is on its own device)"
    elif pc.ranks_per_node != pc.world_size:
        why = "across nodes (the ranks' pools cannot share memory)"
    elif pc.prefill_context_parallel_size > 1:
        why = "with --prefill-context-parallel-size > 1 (each rank keeps a whole KV replica)"
    elif not hasattr(os, "memfd_create"):
        why = "on this OS (no memfd_create)"
    if why:
        raise NotImplementedError(f"KV tiers with more than one rank per engine core are not "
                                  f"supported {why} yet")


def layout_id(config) -> str:
    """The rank layout a logical page follows ('' for one rank): part of the tier fingerprint."""
    pc = config.parallel
    if pc.world_size == 1:
        return ""
    return (f"|tp{pc.tensor_parallel_size}-dcp{pc.decode_context_parallel_size}"
            f"i{pc.dcp_kv_cache_interleave_size}")
