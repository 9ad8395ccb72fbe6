"""DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3 with DeepSeek Sparse Attention.

Everything but attention is DeepSeek-V3's (deepseek_v3.py: MoE, loading, TP plan); each
layer's MLA becomes SparseLatentAttention (layers/sparse_mla.py): a lightning indexer picks
each query's index_topk keys, and MLA attends to those only.

KV cache: L + E specs. Entries 0 .. L-1: the latent rows (MLAAttentionSpec), as V3; entries
L .. L+E-1: the indexer keys (IndexerKeySpec), m layers' keys side by side per entry
(IndexerKeyBank; m = latent row // indexer row, 4 at DeepSeek-V3.2's dims, E = ceil(L / m)),
their own full-attention group, so prefix caching, tiers and P/D handle them as any group. Why
m: every page is as large as the largest group's block; one key (128) per layer beside one
latent row (576) per layer would leave 78% of each indexer page empty (the pool ~61% in use);
with m keys per entry the planner (kv/planning.py group_layers) cuts the latent layers into
groups of E, whose pages hold about the indexer group's bytes (~95% in use at real dims).
Layer i's attention gets (metadata of entry i's group, of entry L + i // m's). With the
checkpoint's MTP layers loaded (`"method": "mtp"`, deepseek_mtp.py: each a V3.2 decoder layer
with a lightning indexer of its own) L counts them too, after the model's N layers: their latent
specs follow the model's and their keys follow the model's in the banks (a spare column of the
last entry when N % m != 0, else one entry more); mtp_kv_groups names their two groups.

TP: as V3 (heads split); the indexer (its heads are summed into one score per key) and its key
cache replicated on every rank. Decode context parallelism (-dcp D): both groups split by token,
the top-k taken over every rank's candidates (layers/sparse_mla.py); TP x DCP (-tp D -dcp D)
as DeepSeek-V3's, with the same top-k. PCP: both caches' prefill rows exchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from loomserve.execution.layers.mla import yarn_softmax_scale
from loomserve.execution.layers.sparse_mla import IndexerKeyBank, SparseLatentAttention
from loomserve.execution.models.deepseek_v3 import (
    DecoderLayer,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV3TP,
)
from loomserve.kv.spec import IndexerKeySpec, KVCacheSpec


@dataclasses.dataclass(frozen=True)
class DeepseekV32Config(DeepseekV3Config):
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 64

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "DeepseekV32Config":
        if not d.get("q_lora_rank"):
            raise ValueError("deepseek_v32 needs q_lora_rank: the indexer reads the query LoRA")
        base = super().from_hf(d)
        types = d.get("mlp_layer_types")
        if types is not None and [t == "sparse" for t in types] != [
                base.is_moe(i) for i in range(base.num_layers)]:
            raise ValueError("mlp_layer_types other than first_k_dense_replace dense layers then "
                             "MoE are not supported")
        if int(d.get("index_head_dim", 128)) < base.qk_rope_head_dim:
            raise ValueError("index_head_dim below qk_rope_head_dim")
        return dataclasses.replace(base, index_topk=int(d.get("index_topk", 2048)),
                                   index_head_dim=int(d.get("index_head_dim", 128)),
                                   index_n_heads=int(d.get("index_n_heads", 64)))


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    config_class = DeepseekV32Config
    tp_plan = DeepseekV3TP()  # the indexer's tensors fall through to "whole" (replicated)
    supports_dcp = True  # each rank scores its keys, the top-k taken globally (layers/sparse_mla.py)
    supports_tp_dcp = True  # TP x DCP as MLA's, the same global top-k (layers/sparse_mla.py)

    def __init__(self, cfg: DeepseekV32Config) -> None:
        super().__init__(cfg)
        for layer in self.model.layers:  # built on the meta device: replacing costs nothing
            layer.self_attn = sparse_attention(cfg)

    @staticmethod
    def decoder_layer(cfg: DeepseekV32Config, i: int) -> nn.Module:
        """Layer i (an MTP layer's too: it has a lightning indexer of its own)."""
        layer = DecoderLayer(cfg, i)
        layer.self_attn = sparse_attention(cfg)
        return layer

    @property
    def keys_per_entry(self) -> int:
        """m: layers whose indexer keys share one cache entry (see the module docstring)."""
        c = self.config
        even = lambda n: (n + 1) // 2 * 2  # noqa: E731 - for_latent's row width
        return max(1, min(c.num_layers, even(c.latent_dim) // even(c.index_head_dim)))

    def _layers(self) -> list[nn.Module]:
        """The decoder layers whose rows the cache holds: the model's, then the MTP layers'."""
        mtp = [m.block for m in self.mtp.layers] if self.mtp is not None else []
        return list(self.model.layers) + mtp

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        m, n = self.keys_per_entry, self.config.num_layers + self._num_mtp()
        key = IndexerKeySpec.for_latent(block_size, m * self.config.index_head_dim, dtype)
        return super().kv_cache_specs(block_size, dtype) + [key] * (-(-n // m))

    def kv_cache_modules(self) -> list[nn.Module]:
        m, indexers = self.keys_per_entry, [layer.self_attn.indexer for layer in self._layers()]
        banks = [IndexerKeyBank(indexers[i:i + m]) for i in range(0, len(indexers), m)]
        return super().kv_cache_modules() + banks

    def layer_groups(self, i: int) -> tuple[int, int]:
        """(latent group, indexer-key group) of layer i (i >= N: MTP layer i - N)."""
        n = self.config.num_layers + self._num_mtp()
        return self.groups[i], self.groups[n + i // self.keys_per_entry]

    def mtp_kv_groups(self, index: int) -> tuple[int, int]:
        """The groups MTP layer `index` reads (spec_mtp.py builds metadata for both)."""
        return self.layer_groups(self.config.num_layers + index)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: Any,
                state_batch: Any = None) -> torch.Tensor:
        """Flattened tokens in, final hidden states out ([tokens, hidden])."""
        cos, sin = self.rotary.lookup(positions)
        rope = (cos, sin, self.rotary.half)
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            lat, idx = self.layer_groups(i)
            x = layer(x, rope, (attn_meta[lat], attn_meta[idx]))
        x = self.model.norm(x)
        if self.mtp is not None:  # the first MTP layer's h_p, as DeepSeek-V3's
            self.last_hidden = x
        return x


def sparse_attention(cfg: DeepseekV32Config) -> SparseLatentAttention:
    return SparseLatentAttention(
        cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.attention_bias,
        yarn_softmax_scale(cfg.head_dim, cfg.rope_scaling), cfg.index_n_heads,
        cfg.index_head_dim, cfg.index_topk)
