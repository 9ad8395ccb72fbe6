"""The attention layers' entry point (see loomserve.execution.attention for the backends).

`build_metadata` here takes plain block-id lists, for tests and tools that build one step by
hand; the runner builds metadata from its incrementally grown tables instead.
"""

from __future__ import annotations

import torch

from loomserve.execution.attention import (
    AttentionMetadata,
    GatherWorkspace,
    PrefillChunk,
    paged_attention,
    select_backend,
    tables_from_lists,
)
from loomserve.execution.attention import build_metadata as _build


def build_metadata(decodes: list[tuple[int, list[int]]], prefills: list[tuple[int, int, list[int]]],
                   block_size: int, device: torch.device, dtype: torch.dtype = torch.float32,
                   sliding_window: int | None = None, backend: str = "auto"):
    """decodes: (position, block ids); prefills: (start_pos, num_tokens, block ids).
    Returns (metadata, positions) for the named backend on `device`."""
    dec_tables = tables_from_lists([t for _, t in decodes])
    pre_tables = tables_from_lists([t for _, _, t in prefills])
    return _build([(p, t) for (p, _), t in zip(decodes, dec_tables)],
                  [(s, n, t) for (s, n, _), t in zip(prefills, pre_tables)],
                  block_size, device, dtype, select_backend(backend, torch.device(device), dtype),
                  sliding_window)


__all__ = ["AttentionMetadata", "GatherWorkspace", "PrefillChunk", "build_metadata", "paged_attention"]
