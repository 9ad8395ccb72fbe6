"""ModelRunner: owns the model, the paged KV buffer and the sampler; turns a ModelInput into tokens.

One step is one forward pass over all scheduled tokens flattened together (decode tokens first,
then prefill chunks), logits only for the rows that end a seq due a token, then sampling. A seq
with drafts (speculative decoding) runs as one decode row per token, each with logits, and is
verified instead of sampled (rejection_sampler.py).

KV groups. The model declares one KVCacheSpec per layer; layers with equal specs form a group,
ordered full attention first, then sliding window, then linear state (within a kind, by first
layer). All groups share ONE pool of num_blocks pages of page_bytes, the largest group's bytes
per block (kv_pool.py; layer-major where every group has the same shape); a block id belongs to
one group at a time, and group g's page holds all of g's layers from byte 0: attention
[layers, 2, block_size, kv_heads, head_dim], linear state the concatenated state tensors of
each layer in turn. Each layer gets views of its region.
Per step: attention metadata per attention group (from ScheduledSeq.block_ids[g]); for state
groups the StateDirectives are applied to whole pages before the forward pass, then a
StateBatch per group is handed to the linear layers (the contract: loomserve.execution.models.registry).
Decode context parallelism (loomserve.execution.parallel.context_parallel): kv_cache_config is the
scheduler's view (blocks of block_size tokens), kv_layout this rank's pool (pages of block_size / D
tokens: its share of each block); without DCP they are the same. Prefill context parallelism
(loomserve.execution.parallel.prefill_context_parallel): each rank runs its rows of the step
(every decode, its piece of each prefill chunk) and gathers every row's hidden state.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import numpy as np
import torch

from loomserve.config import DEFAULT_GPU_KV_FRACTION, EngineConfig
from loomserve.execution import cuda_graphs, memory_profile
from loomserve.execution.attention import (
    BlockTables,
    GatherWorkspace,
    build_metadata,
    select_backend,
)
from loomserve.execution.attention.kv_dtype import cache_dtype
from loomserve.execution.attention.metadata import to_device
from loomserve.execution.batch import ModelInput, ModelOutput, ScheduledSeq
from loomserve.execution.kv_buffer import KVPool
from loomserve.execution.layers.gated_deltanet import GatedDeltaNet
from loomserve.execution.layers.mamba2 import Mamba2Mixer
from loomserve.execution.layers.state import StateBatch, StateSeq
from loomserve.execution.models.loading.loader import load_model
from loomserve.execution.parallel import prefill_context_parallel as pcp
from loomserve.execution.parallel.context_parallel import DcpBackend, layout_for
from loomserve.execution.parallel.shared_pool import map_pool
from loomserve.execution.parallel.state import get_dcp, get_group, get_pcp, get_tp
from loomserve.execution.rejection_sampler import verify
from loomserve.execution.sampler import Sampler
from loomserve.execution.spec_mtp import make_proposer
from loomserve.kv.planning import (
    PageSizing,
    kv_budget_bytes,
    plan_context_parallel,
    plan_kv_cache,
    size_pages,
)
from loomserve.kv.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    LinearStateSpec,
    SlidingWindowSpec,
)
from loomserve.kv.tiers.base import page_bytes_of

log = logging.getLogger("loomserve.execution")


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if os.environ.get("LOOMSERVE_NUM_THREADS"):
            # On a shared CPU host, fewer OpenMP threads than cores avoids spin-waiting on
            # descheduled siblings, which can cost more than the parallelism gains.
            torch.set_num_threads(int(os.environ["LOOMSERVE_NUM_THREADS"]))
        mcfg = config.model
        self.device = mcfg.torch_device
        self.dtype = mcfg.torch_dtype
        self.kv_dtype = cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        loaded = load_model(mcfg.model, self.dtype, self.device, mcfg.resolved_cache_dir, mcfg.quantization,
                            hf_overrides=mcfg.hf_overrides, max_model_len=mcfg.max_model_len)
        self.model, self.model_config = loaded.model, loaded.config
        self.model_name = loaded.name
        self.model_folder = loaded.folder
        # "method": "mtp": the checkpoint's MTP modules, loaded into the model before its KV
        # specs are read (each adds an MLA layer); they draft after each step (spec_mtp.py)
        self.mtp = make_proposer(config, self.model, self.model_folder)
        self.step_seqs: list[ScheduledSeq] = []  # the last forward's seqs in hidden-row order
        mc = self.model_config
        self.vocab_size = mc.vocab_size
        # --max-model-len, checked by the loader against what the (overridden) config's RoPE
        # covers, before any weight was read (arch_config.context_length)
        self.max_model_len = loaded.max_model_len
        # Counted by the loader before the CPU weight layout (which hides packed bf16 linears from
        # parameters()); weight_bytes: the weight bytes a decode step reads (loader.count_weights).
        self.num_params, self.weight_bytes = loaded.num_params, loaded.weight_bytes
        self.quantization = loaded.quantization  # the mode resolved at load (never "auto")
        self.block_size = config.cache.block_size
        self.dcp = layout_for(config, self.block_size)
        # Hybrid models: a larger block size and state groups of a few layers, so attention and
        # state pages hold about the same bytes (planning.size_pages); the configured block size
        # stays under DCP (a rank's page holds a slice of each block).
        self.page_sizing = (size_pages(self._specs(self.block_size), self.block_size,
                                       config.cache.hybrid_block_limit)
                            if self.dcp is None else PageSizing(self.block_size))
        if self.page_sizing.block_size != self.block_size:
            log.info("hybrid KV pages: block size %d (configured %d), %s linear-state layers per "
                     "group: %.1f%% of every page in use", self.page_sizing.block_size,
                     self.block_size, self.page_sizing.state_layers or "all",
                     100 * self.page_sizing.page_use)
        self.block_size = self.page_sizing.block_size
        # --cuda-graphs: one page past the scheduler's blocks, where padded rows write
        self.scratch_pages = 1 if mcfg.cuda_graphs else 0
        self.kv_cache_config = self._kv_cache_config()
        fraction = self._profiled_fraction()
        if fraction is not None:  # a probe pool for the profile step; the real one after it
            self.kv_cache_config = self._kv_cache_config(
                memory_profile.probe_pages(self) * self.kv_layout.page_bytes)
        self.kv_buffer = self._allocate_kv()
        groups = self.kv_cache_config.groups
        self.attn_groups = [g for g, grp in enumerate(groups) if isinstance(grp.spec, FullAttentionSpec)]
        self.state_groups = [g for g, grp in enumerate(groups) if isinstance(grp.spec, LinearStateSpec)]
        self.group_bytes = [grp.bytes_per_block() for grp in self.kv_layout.groups]
        # Pages of state groups hold arbitrary bytes, which read as K/V of another dtype may be
        # NaN; masked positions must be finite, so attention blocks are zeroed when first written.
        self.zero_new_blocks = any(grp.spec.kind not in ("full_attention", "sliding_window")
                                   or grp.spec.dtype != self.kv_dtype for grp in groups)
        self.sampler = Sampler(self.device, mcfg.seed)
        self.workspace = GatherWorkspace()
        self.attention = select_backend(mcfg.attention_backend, self.device, self.dtype)
        if hasattr(self.attention, "kv_bytes_per_token"):  # the CPU kernel's prefetch choice
            self.attention.kv_bytes_per_token = self.kv_layout.page_bytes // self.kv_layout.block_size
        if self.dcp is not None:
            self.attention = DcpBackend(self.attention, self.dcp, get_dcp())
        self.pcp = get_pcp()
        self.tp = get_tp()
        if self.pcp is not None:
            self.attention = pcp.PcpBackend(self.attention, self.pcp)
            pcp.wrap_state_layers(self.model, self.pcp, (GatedDeltaNet, Mamba2Mixer))
        self.block_tables = BlockTables()
        if fraction is not None:
            self._size_pool_by_profile(fraction)
        self.graphs = cuda_graphs.build(self) if mcfg.cuda_graphs else None

    # --- KV cache -----------------------------------------------------------------------------

    def _profiled_fraction(self) -> float | None:
        """The fraction of the device's memory the engine may use, where the pool is sized by
        profiling (memory_profile.py: one CUDA rank, a fractional budget); else None."""
        budget = self.config.cache.kv_cache_memory
        if self.device.type != "cuda" or (budget is not None and budget.bytes is not None) \
                or any(g is not None for g in (self.dcp, get_pcp(), get_tp())):
            return None
        return DEFAULT_GPU_KV_FRACTION if budget is None else budget.fraction

    def _size_pool_by_profile(self, fraction: float) -> None:
        """Run the largest step on the probe pool, then replace it by the pool the measured
        peak leaves room for."""
        probe_bytes = self.kv_layout.num_blocks * self.kv_layout.page_bytes
        peak = memory_profile.activation_peak_bytes(self)
        self.kv_buffer = self.pool = self.tier_pages = None
        budget = memory_profile.pool_budget(self, fraction, probe_bytes, peak)
        self.kv_cache_config = self._kv_cache_config(budget)  # rebinds every layer's views
        self.kv_buffer = self._allocate_kv()

    def _kv_cache_config(self, budget: int | None = None) -> KVCacheConfig:
        """The scheduler's view for `budget` bytes (None: the configured budget); sets
        self.kv_layout (this rank's pool) and self.layer_specs."""
        if budget is None:
            budget = kv_budget_bytes(self.config.cache.kv_cache_memory, self.device)
        if self.dcp is None:
            self.layer_specs = self._specs(self.block_size)
            self.kv_layout = plan_kv_cache(self.layer_specs, self.block_size, budget,
                                           self.page_sizing.state_layers)
            return self.kv_layout
        d = self.dcp
        self.layer_specs = self._specs(d.local_block_size)
        self.kv_layout, view = plan_context_parallel(self.layer_specs, self.block_size, d.size,
                                                     budget)
        log.info("DCP rank %d of %d: %d blocks, a page holding %d of a block's %d tokens: the "
                 "pool holds %d tokens, %d of them on this rank", d.rank, d.size,
                 view.num_blocks, d.local_block_size, self.block_size, view.capacity_tokens,
                 self.kv_layout.capacity_tokens)
        return view

    def _specs(self, block_size: int) -> list:
        """The model's per-layer specs, attention rows in the --kv-cache-dtype (state layers
        keep the model's dtype: their recurrences accumulate in it)."""
        specs = list(self.model.kv_cache_specs(block_size, self.dtype))
        return [dataclasses.replace(s, dtype=self.kv_dtype) if isinstance(s, FullAttentionSpec)
                else s for s in specs]

    def _allocate_kv(self) -> torch.Tensor:
        """The pool of pages (kv_pool.py: layer-major where it fits); every layer gets views of
        its region of each page. Returns the page tensor (pages[b]: block b's page)."""
        kc = self.kv_layout
        n, page = kc.num_blocks, kc.page_bytes
        fd = self.config.parallel.shared_kv_fd
        if fd is not None:  # every rank's pool in one shared buffer, for the KV tiers
            group = get_group()
            self.tier_pages, buf = map_pool(fd, n, page, group.rank, group.size)
            self.pool = KVPool.of_pages(buf)
        else:
            self.pool = KVPool.allocate(dataclasses.replace(kc, num_blocks=n + self.scratch_pages),
                                        self.device)
            self.tier_pages = self.pool.pages  # what KV tiers and transfers move: whole pages
        layer_group: list[int | None] = [None] * len(self.layer_specs)
        modules = _cache_modules(self.model, len(self.layer_specs))
        for g, grp in enumerate(kc.groups):
            spec, per_layer = grp.spec, grp.spec.bytes_per_block_per_layer()
            for slot, layer in enumerate(grp.layer_ids):
                layer_group[layer] = g
                if isinstance(spec, FullAttentionSpec):
                    kv = self.pool.layer_view(slot, per_layer, 0, spec.dtype,
                                              (2, spec.block_size, spec.num_kv_heads, spec.head_dim))
                    modules[layer].k_cache, modules[layer].v_cache = kv[:, 0], kv[:, 1]
                elif isinstance(spec, LinearStateSpec):
                    views, off = [], 0
                    for shape in spec.state_shapes:
                        views.append(self.pool.layer_view(slot, per_layer, off, spec.dtype, shape))
                        off += math.prod(shape) * spec.dtype.itemsize
                    modules[layer].state_cache = tuple(views)
                else:
                    raise NotImplementedError(f"no page layout for layer kind {spec.kind!r}")
        self.model.set_layer_groups(layer_group)
        return self.pool.pages

    @property
    def scratch_page(self) -> int:
        """The page past the scheduler's blocks (--cuda-graphs' padded rows write there)."""
        assert self.scratch_pages, "no scratch page: the pool was planned without --cuda-graphs"
        return self.kv_layout.num_blocks

    @property
    def tier_page_bytes(self) -> int:
        """Bytes of one page as the KV tiers see it (every rank's shard under a shared pool)."""
        return page_bytes_of(self.tier_pages)

    # --- step ---------------------------------------------------------------------------------

    def execute(self, inp: ModelInput) -> ModelOutput:
        out = self._execute(inp)
        if self.mtp is not None:  # the next step's drafts, from this step's hidden states
            out.drafts = self.mtp.propose(self, self.step_seqs, out, inp.finished_request_ids)
        return out

    @torch.inference_mode()
    def _execute(self, inp: ModelInput) -> ModelOutput:
        due, logits = self.compute_logits(inp)
        if not due:
            return ModelOutput(sampled={})
        if any(s.num_draft for s in due):  # speculative decoding: drafts to verify
            return verify(self.sampler, logits, due, inp.token_bitmask)
        out = self.sampler.sample(logits, due, inp.token_bitmask)
        return ModelOutput(sampled={s.request_id: t for s, t in zip(due, out.tokens)},
                           logprobs={due[i].request_id: lp for i, lp in out.logprobs.items()})

    @torch.inference_mode()
    def compute_logits(self, inp: ModelInput) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """Forward pass; returns the seqs with sample=True (batch order) and their fp32 logits
        (one row each; a seq with drafts: its last 1 + num_draft rows)."""
        seqs = [s for s in inp.seqs if s.token_ids]
        if not seqs:
            return [], torch.empty(0, self.vocab_size, device=self.device)
        # a seq with drafts runs as decode rows, one per token (_draft_rows)
        decodes = [s for s in seqs if len(s.token_ids) == 1 or s.num_draft]
        prefills = [s for s in seqs if len(s.token_ids) > 1 and not s.num_draft]
        for s in seqs:
            if s.start_pos + len(s.token_ids) > self.max_model_len:
                raise ValueError(f"request {s.request_id} runs past max_model_len={self.max_model_len}")
        ids: list[int] = []
        last_row: dict[int, int] = {}  # id(seq) -> row of its last token in the flattened batch
        for s in decodes + prefills:
            ids.extend(s.token_ids)
            last_row[id(s)] = len(ids) - 1
        self.step_seqs = decodes + prefills  # the hidden rows' order, seq by seq
        if any(s.num_draft for s in decodes):
            decodes = _draft_rows(decodes)
        ordered = decodes + prefills
        self._forget(inp, seqs)
        tables = self.block_tables
        if self.graphs is not None and not prefills and self.graphs.fits(len(decodes)):
            hidden = self.graphs.run(decodes, lambda s, g: tables.get(s.request_id, g,
                                                                      s.block_ids[g]))
            return self._sampled_logits(seqs, hidden, last_row)
        groups = self.kv_cache_config.groups
        attn_meta: list = [None] * len(groups)
        positions = None
        for g in self.attn_groups:
            spec = groups[g].spec
            meta, positions = build_metadata(
                [(s.start_pos, tables.get(s.request_id, g, s.block_ids[g])) for s in decodes],
                [(s.start_pos, len(s.token_ids), tables.get(s.request_id, g, s.block_ids[g]))
                 for s in prefills],
                self.block_size, self.device, self.dtype, self.attention,
                spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None, self.workspace,
                new_blocks=self.zero_new_blocks)
            if self.dcp is not None:
                self.attention.localize(meta, positions)
            if self.zero_new_blocks:
                self._zero_new_blocks(meta, g)
            attn_meta[g] = meta
        split = self._pcp_localize(attn_meta, len(decodes)) if self.pcp is not None else None
        if positions is None:
            positions = torch.tensor([p for s in ordered for p in range(s.start_pos, s.start_pos + len(s.token_ids))],
                                     dtype=torch.long, device=self.device)
        state_batch: list = [None] * len(groups)
        if self.state_groups:
            self._apply_state_directives(ordered)
            for g in self.state_groups:
                state_batch[g] = self._state_batch(ordered, g)
                state_batch[g].pcp = split  # PCP: the layer gathers every row (PcpStateLayer)
        input_ids = to_device(np.array(ids, dtype=np.int64), self.device)
        if split is not None:  # PCP: this rank's rows only, then every row's hidden state
            local = split.local_index.to(self.device)
            hidden = pcp.full_hidden(self.pcp, split, self.model(
                input_ids[local], positions[local], attn_meta, state_batch), len(ids))
        else:
            hidden = self.model(input_ids, positions, attn_meta, state_batch)
        return self._sampled_logits(seqs, hidden, last_row)

    def _sampled_logits(self, seqs: list[ScheduledSeq], hidden: torch.Tensor,
                        last_row: dict[int, int]) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """The seqs due a token and the fp32 logits of their last rows of `hidden`."""
        due = [s for s in seqs if s.sample]
        # rank 0 samples; under TP every rank takes part in the logits (vocab-parallel gather)
        if not due or (self.tp is None and
                       any(g is not None and g.rank != 0 for g in (self.dcp, self.pcp))):
            return [], torch.empty(0, self.vocab_size, device=self.device)
        # pinned and non-blocking: a pageable copy here would wait for the queued forward
        if any(s.num_draft for s in due):  # drafts to verify: logits of all 1 + d last rows
            rows = to_device(np.array([r for s in due for r in range(
                last_row[id(s)] - s.num_draft, last_row[id(s)] + 1)], dtype=np.int64),
                self.device)
        else:
            rows = to_device(np.array([last_row[id(s)] for s in due], dtype=np.int64),
                             self.device)
        return due, self.model.compute_logits(hidden[rows]).float()

    def _zero_new_blocks(self, meta, g: int) -> None:
        """Zero the pages whose first slot this step writes (from the host copy: no device
        sync; DCP's localized metadata has none and derives them on the device)."""
        if meta.new_blocks is None:
            fresh = meta.slot_blocks[meta.slot_offsets == 0]
        elif len(meta.new_blocks):
            fresh = to_device(meta.new_blocks, self.device)
        else:
            return
        if fresh.numel():
            self.pool.zero(fresh, self.group_bytes[g])

    def _pcp_localize(self, attn_meta: list, num_decode: int) -> "pcp.PcpSplit":
        """PCP: this rank's rows of the step, and every attention group's metadata for them."""
        first = attn_meta[self.attn_groups[0]]
        split = pcp.PcpSplit.of(num_decode, first.prefills, self.pcp.rank, self.pcp.size)
        for g in self.attn_groups:
            pcp.localize(attn_meta[g], split, self.pcp.rank)
        return split

    def _forget(self, inp: ModelInput, seqs: list[ScheduledSeq]) -> None:
        """Drop the block tables of finished requests; bound what aborts may leave behind."""
        if inp.finished_request_ids:
            self.block_tables.drop(inp.finished_request_ids)
        if len(self.block_tables) > 4 * max(64, len(seqs)):
            self.block_tables.keep_only({s.request_id for s in seqs})

    # --- linear-state groups ------------------------------------------------------------------

    def _apply_state_directives(self, seqs: list[ScheduledSeq]) -> None:
        """init_from: one whole-page copy into running_block; zero_init: zero the group's region.
        Done for every seq before the forward pass, so layers see ready states."""
        src, dst, zero = [], [], {}
        for s in seqs:
            for g, d in s.states.items():
                if d.init_from is not None:
                    src.append(d.init_from)
                    dst.append(d.running_block)
                elif d.zero_init:
                    zero.setdefault(g, []).append(d.running_block)
        buf = self.kv_buffer
        if src:
            s_ids = torch.tensor(src, dtype=torch.long, device=self.device)
            buf[torch.tensor(dst, dtype=torch.long, device=self.device)] = buf[s_ids]
        for g, blocks in zero.items():
            self.pool.zero(torch.tensor(blocks, dtype=torch.long, device=self.device),
                           self.group_bytes[g])

    def _state_batch(self, seqs: list[ScheduledSeq], g: int) -> StateBatch:
        out, row = [], 0
        for s in seqs:
            n = len(s.token_ids)
            d = s.states.get(g)
            if d is None:
                raise ValueError(f"request {s.request_id} has no state directive for KV group {g}")
            out.append(StateSeq(row, row + n, s.start_pos, d.running_block, list(d.saves)))
            row += n
        return StateBatch(out)


def _draft_rows(decodes: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """The decode rows of a step whose seqs with drafts (speculative decoding) each become
    1 + num_draft decode rows of the same request at consecutive positions. Every row's K/V is
    written before attention reads the cache, so the row at position p sees the rows before it:
    causal, through the decode kernels (the decode stack on a CPU), the same arithmetic as
    decoding the tokens one at a time. Row order equals the flattened token order.
    Linear-state groups: the rows share the running page, and the state layers take a
    request's rows in order (gated_deltanet.decode_waves); each row carries the saves that
    fall after it (the draft states the KV manager keeps for rollback), and only the first the
    page copy or zeroing that starts the step."""
    out = []
    for s in decodes:
        if not s.num_draft:
            out.append(s)
            continue
        for j, t in enumerate(s.token_ids):
            p = s.start_pos + j
            states = {g: dataclasses.replace(
                d, init_from=d.init_from if j == 0 else None, zero_init=d.zero_init and j == 0,
                saves=[(n, page) for n, page in d.saves if n == p + 1])
                for g, d in s.states.items()}
            out.append(ScheduledSeq(s.request_id, [t], p, s.block_ids, False, s.sampling,
                                    states=states))
    return out


def _cache_modules(model, num_layers: int) -> list:
    if hasattr(model, "kv_cache_modules"):
        return list(model.kv_cache_modules())
    out = []
    for layer in model.model.layers:
        found = None
        for name in ("self_attn", "linear_attn", "mixer"):
            m = getattr(layer, name, None)
            if m is not None and (hasattr(m, "k_cache") or hasattr(m, "state_cache")):
                found = m
                break
        out.append(found)
    return out
