"""ModelRunner: owns the model, the paged KV buffer and the sampler; turns a ModelInput into tokens.

One step is one forward pass over all scheduled tokens flattened together (decode tokens first,
then prefill chunks), logits only for the rows that end a seq due a token, then sampling.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from loomserve.batch import ModelInput, ModelOutput, ScheduledSeq
from loomserve.config import DEFAULT_CPU_KV_BYTES, DEFAULT_GPU_KV_FRACTION, EngineConfig, parse_memory
from loomserve.kv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from loomserve.model.attention import GatherWorkspace, build_metadata
from loomserve.model.loader import load_model
from loomserve.model.sampler import Sampler


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if os.environ.get("LOOMSERVE_NUM_THREADS"):
            # On a shared CPU host, fewer OpenMP threads than cores avoids spin-waiting on
            # descheduled siblings, which can cost more than the parallelism gains.
            torch.set_num_threads(int(os.environ["LOOMSERVE_NUM_THREADS"]))
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        loaded = load_model(config.model, self.dtype, self.device, config.resolved_cache_dir)
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.model_name = loaded.name
        self.model_folder = loaded.folder
        mc = self.model_config
        self.vocab_size = mc.vocab_size
        limit = mc.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}")
        self.max_model_len = config.max_model_len or limit
        params = list(self.model.parameters())
        self.num_params = sum(p.numel() for p in params)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in params)
        self.block_size = config.block_size
        self.kv_cache_config = self._kv_cache_config()
        self.kv_buffer = self._allocate_kv()
        self.sampler = Sampler(self.device, config.seed)
        self.workspace = GatherWorkspace()

    # --- KV cache -----------------------------------------------------------------------------

    def _kv_cache_config(self) -> KVCacheConfig:
        mc = self.model_config
        spec = FullAttentionSpec(self.block_size, mc.num_kv_heads, mc.head_dim, self.dtype)
        groups = (KVCacheGroup(spec, tuple(range(mc.num_layers))),)
        num_blocks = KVCacheConfig.num_blocks_for(self._kv_budget_bytes(), groups)
        if num_blocks < 1:
            raise ValueError("kv-cache-memory is too small to hold one block")
        return KVCacheConfig(num_blocks, groups)

    def _kv_budget_bytes(self) -> int:
        cuda = self.device.type == "cuda"
        if self.config.kv_cache_memory is None:
            if not cuda:
                return DEFAULT_CPU_KV_BYTES
            kind, value = "fraction", DEFAULT_GPU_KV_FRACTION
        else:
            kind, value = parse_memory(str(self.config.kv_cache_memory))
        if kind == "bytes":
            return int(value)
        if cuda:
            free, _ = torch.cuda.mem_get_info(self.device)  # measured after the weights are in
            return int(free * value)
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * value)

    def _allocate_kv(self) -> torch.Tensor:
        """One backing buffer of packed pages; every layer gets strided K and V views into it."""
        kc, mc = self.kv_cache_config, self.model_config
        if self.device.type == "cpu":
            # calloc'd memory is zero-filled by the OS on first touch, so resident memory grows
            # with the pages actually used instead of the whole budget at start.
            buf = torch.from_numpy(np.zeros((kc.num_blocks, kc.page_bytes), dtype=np.uint8))
        else:
            buf = torch.zeros(kc.num_blocks, kc.page_bytes, dtype=torch.uint8, device=self.device)
        pages = buf.view(self.dtype).view(kc.num_blocks, mc.num_layers, 2, self.block_size,
                                          mc.num_kv_heads, mc.head_dim)
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.k_cache = pages[:, i, 0]
            layer.self_attn.v_cache = pages[:, i, 1]
        return buf

    # --- step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> ModelOutput:
        due, logits = self.compute_logits(inp)
        if not due:
            return ModelOutput(sampled={})
        tokens = self.sampler(logits, [s.sampling for s in due], [s.num_output_tokens for s in due])
        return ModelOutput(sampled={s.request_id: t for s, t in zip(due, tokens)})

    @torch.inference_mode()
    def compute_logits(self, inp: ModelInput) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """Forward pass; returns the seqs with sample=True (batch order) and their fp32 logits."""
        seqs = [s for s in inp.seqs if s.token_ids]
        if not seqs:
            return [], torch.empty(0, self.vocab_size, device=self.device)
        decodes = [s for s in seqs if len(s.token_ids) == 1]
        prefills = [s for s in seqs if len(s.token_ids) > 1]
        for s in seqs:
            if s.start_pos + len(s.token_ids) > self.max_model_len:
                raise ValueError(f"request {s.request_id} runs past max_model_len={self.max_model_len}")
        ids: list[int] = []
        last_row: dict[int, int] = {}  # id(seq) -> row of its last token in the flattened batch
        for s in decodes + prefills:
            ids.extend(s.token_ids)
            last_row[id(s)] = len(ids) - 1
        meta, positions = build_metadata(
            [(s.start_pos, s.block_ids[0]) for s in decodes],
            [(s.start_pos, len(s.token_ids), s.block_ids[0]) for s in prefills],
            self.block_size, self.device, self.dtype)
        meta.workspace = self.workspace
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, meta)
        due = [s for s in seqs if s.sample]
        if not due:
            return [], torch.empty(0, self.vocab_size, device=self.device)
        rows = torch.tensor([last_row[id(s)] for s in due], dtype=torch.long, device=self.device)
        return due, self.model.compute_logits(hidden[rows]).float()
