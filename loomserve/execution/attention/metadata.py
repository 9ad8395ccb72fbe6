"""What one step's attention needs, built once per step per KV group (not per layer).

A step's tokens are flattened into one sequence, decode tokens first and prefill chunks after,
so every layer sees one contiguous slice per kind. The metadata holds small integer arrays only:
where each new K/V row goes (slot blocks and offsets), each decode's key count and block table,
each prefill chunk's start position and block table. Tables are the runner's incrementally grown
int32 arrays (BlockTables), passed by reference: building metadata is O(sequences + new tokens),
whatever the context length. Anything a backend derives from them (pointer arrays for the C
kernel, padded tables and masks for the torch path) it builds on the first layer that needs it
and keeps in `derived`, so the other layers of the group reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the flattened batch
    end: int
    start_pos: int
    table: np.ndarray  # int32 block table covering positions < start_pos + (end - start)


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [tokens] block id each new K/V row is written to
    slot_offsets: torch.Tensor  # [tokens] offset inside that block
    block_size: int
    backend: Any  # an AttentionBackend (loomserve.execution.attention.backends)
    num_decode: int = 0
    decode_lens: np.ndarray | None = None  # int32 [decodes]: keys per decode (its position + 1)
    decode_tables: list[np.ndarray] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    sliding_window: int | None = None  # W: a query at p sees keys p - W + 1 .. p
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    workspace: Any = None  # the runner's GatherWorkspace, reused across steps
    derived: dict = field(default_factory=dict)  # per-step, built by backends on first use
    # Decode context parallelism: the rows of the step's K/V this rank stores (slot_blocks and
    # slot_offsets are theirs); None: every row (parallel/context_parallel.py)
    write_rows: torch.Tensor | None = None
    # Host copy of the blocks whose first slot this step writes (the runner zeroes them where
    # pages may hold other groups' bytes, without a device sync); None: not asked for, or
    # localized by DCP (then derived on the device).
    new_blocks: np.ndarray | None = None


def staged(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array ready to copy to `device` without blocking the host: pinned for CUDA
    (torch's caching host allocator keeps it alive until the copy has run), else as it is."""
    t = torch.from_numpy(a)
    return t.pin_memory() if device.type == "cuda" else t


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on `device` (on a CPU the array's own memory)."""
    return staged(a, device).to(device, non_blocking=True)


def build_metadata(decodes: list[tuple[int, np.ndarray]], prefills: list[tuple[int, int, np.ndarray]],
                   block_size: int, device: torch.device, dtype: torch.dtype, backend,
                   sliding_window: int | None = None, workspace=None,
                   new_blocks: bool = False) -> tuple[AttentionMetadata, torch.Tensor]:
    """decodes: (position, table) per decode token, in batch order, before the prefills.
    prefills: (start_pos, num_tokens, table) per chunk. new_blocks: also keep the host ids of
    the blocks whose first slot the step writes. Returns metadata and positions."""
    d = len(decodes)
    dec_pos = np.fromiter((p for p, _ in decodes), dtype=np.int64, count=d)
    parts_pos, parts_blk = [dec_pos], [np.fromiter((t[p // block_size] for p, t in decodes),
                                                    dtype=np.int64, count=d)]
    chunks, row = [], d
    for start_pos, n, table in prefills:
        pos = np.arange(start_pos, start_pos + n, dtype=np.int64)
        parts_pos.append(pos)
        parts_blk.append(table[pos // block_size].astype(np.int64))
        chunks.append(PrefillChunk(row, row + n, start_pos, table))
        row += n
    positions = np.concatenate(parts_pos) if len(parts_pos) > 1 else dec_pos
    blocks = np.concatenate(parts_blk) if len(parts_blk) > 1 else parts_blk[0]
    offsets = positions % block_size
    meta = AttentionMetadata(
        slot_blocks=to_device(blocks, device),
        slot_offsets=to_device(offsets, device),
        block_size=block_size, backend=backend, num_decode=d,
        decode_lens=(dec_pos + 1).astype(np.int32) if d else None,
        decode_tables=[t for _, t in decodes], prefills=chunks,
        sliding_window=sliding_window, dtype=dtype, device=device, workspace=workspace,
        new_blocks=blocks[offsets == 0] if new_blocks else None)
    return meta, to_device(positions, device)


def first_visible(pos: int, window: int | None) -> int:
    """The first key position a query at `pos` sees."""
    return 0 if window is None else max(0, pos - window + 1)


def padded_decode_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode rows' block tables padded to the longest, [decodes, width] (padding repeats a
    row's last block: finite data), and the valid-key mask [decodes, width * block_size]; built
    once per step in `derived`. A row with no keys (a decode-context-parallel rank that holds
    none of a short sequence) reads its first block, all masked."""
    got = meta.derived.get("decode_tables")
    if got is not None:
        return got
    bs = meta.block_size
    lens = meta.decode_lens.astype(np.int64)
    lasts = np.maximum((lens - 1) // bs, 0)
    cols = np.minimum(np.arange(int(lasts.max()) + 1)[None, :], lasts[:, None])
    tables = np.stack([t[c] for t, c in zip(meta.decode_tables, cols)]).astype(np.int64)
    valid = torch.arange(cols.shape[1] * bs)[None, :] < torch.from_numpy(lens)[:, None]
    got = (torch.from_numpy(tables).to(meta.device), valid.to(meta.device))
    meta.derived["decode_tables"] = got
    return got
