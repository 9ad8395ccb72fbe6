"""CUDA graphs for decode steps (--cuda-graphs): the model's forward captured once per batch
size; a step of b decodes (no prefill) replays the smallest captured size >= b.

A replay reads static buffers the graph was captured on: input ids, positions, key counts, and
per attention group the rows' KV slots and block tables [size, max blocks]. The Triton decode
kernel divides each row's keys itself, so no kernel argument depends on the context; tables and
counts are refreshed before each replay. Rows b .. size - 1 are padding: token 0 at position 0
over one key, written into a scratch page the scheduler never hands out (the pool's last page).
The LM head and sampling run after the replay, on the real rows only.

Eligible: the triton attention backend, attention-only KV groups (no linear-state layers), one
rank (no TP/DCP/PCP). A forward that cannot be captured (a host sync, a data-dependent shape)
fails its capture with an error; that is logged and the engine runs eagerly. On a CPU there are
no graphs: the same static-buffer path runs eagerly (how the tests check it).
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from loomserve.execution.attention.metadata import AttentionMetadata, staged
from loomserve.kv.spec import FullAttentionSpec, SlidingWindowSpec

log = logging.getLogger("loomserve.execution")
SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in SIZES if s <= max_num_seqs]
    return sizes if sizes and sizes[-1] == max_num_seqs else sizes + [min(max_num_seqs, 512)]


def ineligible(runner) -> str | None:
    """Why the runner's decode steps cannot be captured, or None."""
    if getattr(runner.attention, "name", None) != "triton":
        return "it needs --attention-backend triton (auto on CUDA)"
    if runner.state_groups or runner.zero_new_blocks:
        return "the model has linear-state layers (or pages that must be zeroed when started)"
    if any(g is not None for g in (runner.dcp, runner.pcp, runner.tp)):
        return "it runs on one rank only"
    if runner.pool.pages.shape[0] <= runner.kv_layout.num_blocks:
        return "the pool has no scratch page (a shared pool)"
    return None


class DecodeGraphs:
    """Static buffers and one captured forward per batch size."""

    def __init__(self, runner, sizes: list[int]) -> None:
        self.runner = runner
        self.sizes = sorted(sizes)
        dev, size = runner.device, self.sizes[-1]
        self.scratch = runner.scratch_page
        width = -(-runner.max_model_len // runner.block_size)
        self.ids = torch.zeros(size, dtype=torch.long, device=dev)
        self.positions = torch.zeros(size, dtype=torch.long, device=dev)
        self.offsets = torch.zeros(size, dtype=torch.long, device=dev)
        self.lens = torch.ones(size, dtype=torch.int32, device=dev)
        self.slots = {g: torch.full((size,), self.scratch, dtype=torch.long, device=dev)
                      for g in runner.attn_groups}
        self.tables = {g: torch.full((size, width), self.scratch, dtype=torch.int32, device=dev)
                       for g in runner.attn_groups}
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.replayed = dict.fromkeys(self.sizes, 0)  # replays per size (tests, stats)
        self.pool = None

    # --- capture ----------------------------------------------------------------------------

    def _metas(self, size: int) -> list:
        r = self.runner
        groups = r.kv_cache_config.groups
        metas: list = [None] * len(groups)
        for g in r.attn_groups:
            spec = groups[g].spec
            assert isinstance(spec, FullAttentionSpec)
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            meta = AttentionMetadata(self.slots[g][:size], self.offsets[:size], r.block_size,
                                     r.attention, num_decode=size, sliding_window=window,
                                     dtype=r.dtype, device=r.device, workspace=r.workspace)
            splits = r.attention.splits_for(size, spec.num_kv_heads)
            meta.derived["triton_decode"] = (self.tables[g][:size], self.lens[:size], splits)
            metas[g] = meta
        return metas

    def _forward(self, size: int) -> torch.Tensor:
        metas = self._metas(size)
        return self.runner.model(self.ids[:size], self.positions[:size], metas,
                                 [None] * len(metas))

    @torch.inference_mode()
    def capture(self) -> None:
        """Every size, largest first (they share one memory pool), after a warm-up run (Triton
        compiles, cuBLAS workspaces) on a side stream. On a CPU: the eager stand-in."""
        if self.runner.device.type != "cuda":
            for size in self.sizes:
                self.replays[size] = (lambda s: lambda: self._forward(s))(size)
            return
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            side = torch.cuda.Stream(self.runner.device)
            side.wait_stream(torch.cuda.current_stream(self.runner.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(size)
            torch.cuda.current_stream(self.runner.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._forward(size)
            self.replays[size] = (lambda g, o: lambda: (g.replay(), o)[1])(graph, out)
        torch.cuda.synchronize(self.runner.device)

    # --- replay -----------------------------------------------------------------------------

    def fits(self, num_decodes: int) -> bool:
        return 0 < num_decodes <= self.sizes[-1]

    @torch.inference_mode()
    def run(self, decodes, tables) -> torch.Tensor:
        """Hidden states [len(decodes), hidden] of a decode-only step. `tables(seq, g)`: the
        seq's block table of group g (the runner's int32 arrays)."""
        b = len(decodes)
        size = next(s for s in self.sizes if s >= b)
        bs = self.runner.block_size
        pos = np.zeros(size, dtype=np.int64)
        pos[:b] = [s.start_pos for s in decodes]
        ids = np.zeros(size, dtype=np.int64)
        ids[:b] = [s.token_ids[0] for s in decodes]
        _fill(self.positions[:size], pos)
        _fill(self.ids[:size], ids)
        _fill(self.offsets[:size], pos % bs)
        _fill(self.lens[:size], pos.astype(np.int32) + 1)
        nblocks = pos[:b] // bs + 1
        width = int(nblocks.max())
        for g in self.runner.attn_groups:
            table = np.full((size, width), self.scratch, dtype=np.int32)
            for i, s in enumerate(decodes):
                table[i, :nblocks[i]] = tables(s, g)[:nblocks[i]]
            slots = np.full(size, self.scratch, dtype=np.int64)
            slots[:b] = table[np.arange(b), pos[:b] // bs]
            _fill(self.tables[g][:size, :width], table)
            _fill(self.slots[g][:size], slots)
        self.replayed[size] += 1
        return self.replays[size]()[:b]


def _fill(dst: torch.Tensor, a: np.ndarray) -> None:
    """dst <- a host array, not blocking the host on CUDA."""
    dst.copy_(staged(a, dst.device), non_blocking=True)


def build(runner) -> DecodeGraphs | None:
    """The runner's decode graphs, captured; None (logged) where they cannot be used."""
    why = ineligible(runner)
    if why is not None:
        log.warning("--cuda-graphs: not used, %s; decode steps run eagerly", why)
        return None
    graphs = DecodeGraphs(runner, capture_sizes(runner.config.scheduler.max_num_seqs))
    try:
        graphs.capture()
    except Exception as e:  # noqa: BLE001 - a forward that cannot be captured runs eagerly
        log.warning("--cuda-graphs: capture failed (%s: %s); decode steps run eagerly",
                    type(e).__name__, e)
        return None
    log.info("--cuda-graphs: decode steps of %s sequences captured", graphs.sizes)
    return graphs
