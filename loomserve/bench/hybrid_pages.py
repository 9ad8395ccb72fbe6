"""KV page use of hybrid models at real dimensions (issue 44): what share of every page's bytes
each layer group fills, and how many tokens a GiB of pages holds beside the unpadded ideal,
under the old sizing (one block size, every page as large as the largest group's block) and
under kv/planning.py size_pages (a larger block, state layers split into groups).

The dimensions are config.json fields only, no weights. With no network here they were taken
from the installed transformers 5.25's configuration classes (the defaults each class documents
for the checkpoint named in its docstring), one record per model in MODELS. Qwen3-Next and
Nemotron-H specs come from loomserve's own model classes (built on the meta device, so no
memory), Kimi Linear likewise from loomserve's KimiLinearForCausalLM (its Kimi Delta Attention
state: conv window over q, k, v and a per-head [head_dim, head_dim] recurrent state), Qwen3.5
from the spec classes with the state shapes of loomserve's Gated DeltaNet layer.

Tokens per GiB: pages of one GiB given to attention, each token taking one block in every
attention group, against one GiB divided by the attention bytes per token of all layers; a
state needs a few pages per request, not per token, so it is left out of both.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from loomserve.execution.layers.gated_deltanet import GatedDeltaNet
from loomserve.execution.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM
from loomserve.execution.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM
from loomserve.execution.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from loomserve.kv.planning import HYBRID_MAX_BLOCK_TOKENS, group_layers, size_pages
from loomserve.kv.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    LinearStateSpec,
)

GIB = 1 << 30

# Nemotron-3-Nano-30B-A3B's layer pattern ("M" Mamba2, "E" MoE, "*" attention): as transformers
# 5.25 writes it into Nemotron3_5TranscribeConfig's text_config (the same Nano text model).
_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"

MODELS: dict[str, dict[str, Any]] = {
    "Qwen3-Next-80B-A3B": {
        "repo": "Qwen/Qwen3-Next-80B-A3B-Instruct",
        "source": "transformers 5.25 Qwen3NextConfig defaults (its docstring: 'defaults yield "
                  "Qwen/Qwen3-Next-80B-A3B-Instruct'), read 2026-12-06",
        "arch": "qwen3_next",
        "config": {
            "hidden_size": 2048, "vocab_size": 151936, "num_hidden_layers": 48,
            "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 256, "intermediate_size": 5632, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
            "num_experts_per_tok": 10, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
            "partial_rotary_factor": 0.25, "rope_theta": 10000.0, "torch_dtype": "bfloat16"},
    },
    "Kimi-Linear-48B-A3B": {
        "repo": "moonshotai/Kimi-Linear-48B-A3B-Instruct",
        "source": "transformers 5.25 KimiLinearConfig defaults (docstring checkpoint "
                  "moonshotai/Kimi-Linear-48B-A3B-Instruct) for the dimensions; the layer "
                  "lists are the checkpoint's linear_attn_config (1-based MLA layers 4, 8, ..., "
                  "24, 27), as public copies of its config.json quote them (code search; "
                  "transformers' own default layer_types put MLA at 5, 9, ..., 25 instead), "
                  "read 2026-12-06",
        "arch": "kimi_linear",
        "config": {
            "num_hidden_layers": 27, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": None,
            "num_attention_heads": 32, "vocab_size": 163840, "intermediate_size": 9216,
            "moe_intermediate_size": 1024, "num_experts": 256, "num_experts_per_token": 8,
            "num_shared_experts": 1, "first_k_dense_replace": 1,
            "linear_num_heads": 32, "linear_head_dim": 128, "linear_conv_kernel_dim": 4,
            "hidden_size": 2304, "torch_dtype": "bfloat16",
            "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                                   "kda_layers": [i for i in range(1, 28)
                                                  if i not in (4, 8, 12, 16, 20, 24, 27)]}},
    },
    "Nemotron-3-Nano-30B-A3B": {
        "repo": "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
        "source": "transformers 5.25 NemotronHConfig defaults (docstring checkpoint "
                  "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16) with the Nano text model's "
                  "overrides from Nemotron3_5TranscribeConfig (hidden 2688, pattern, 64 Mamba "
                  "heads, 2 KV heads), read 2026-12-06",
        "arch": "nemotron_h",
        "config": {
            "hidden_size": 2688, "vocab_size": 131072, "hybrid_override_pattern": _NANO_PATTERN,
            "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
            "intermediate_size": 1856, "mamba_num_heads": 64, "mamba_head_dim": 64,
            "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "n_routed_experts": 128,
            "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
            "moe_shared_expert_intermediate_size": 3712, "torch_dtype": "bfloat16"},
    },
    "Qwen3.5 (transformers defaults)": {
        "repo": "Qwen/Qwen3.5-27B",
        "source": "transformers 5.25 Qwen3_5TextConfig defaults (its docstring names "
                  "Qwen/Qwen3.5-27B; the defaults are a 32-layer, 4096-hidden text model, "
                  "which may not be that checkpoint's own dimensions: not checked, no "
                  "network), read 2026-12-06",
        "arch": "qwen3_5",
        "config": {
            "hidden_size": 4096, "num_hidden_layers": 32, "full_attention_interval": 4,
            "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4, "torch_dtype": "bfloat16"},
    },
}


@functools.lru_cache(maxsize=None)
def _model_specs(name: str) -> tuple[KVCacheSpec | None, ...]:
    """The model's per-layer specs at block size 1 in its bf16 dtype (linear states fp32)."""
    m = MODELS[name]
    d, arch = m["config"], m["arch"]
    dtype = torch.bfloat16
    if arch in ("qwen3_next", "nemotron_h", "kimi_linear"):
        cfg_cls, model_cls = {"qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
                              "nemotron_h": (NemotronHConfig, NemotronHForCausalLM),
                              "kimi_linear": (KimiLinearConfig, KimiLinearForCausalLM)}[arch]
        with torch.device("meta"):  # the real model's modules, no memory
            model = model_cls(cfg_cls.from_hf(d))
        return tuple(model.kv_cache_specs(1, dtype))
    if arch == "qwen3_5":
        n, every = d["num_hidden_layers"], d["full_attention_interval"]
        with torch.device("meta"):
            gdn = GatedDeltaNet(d["hidden_size"], d["linear_num_key_heads"],
                                d["linear_num_value_heads"], d["linear_key_head_dim"],
                                d["linear_value_head_dim"], d["linear_conv_kernel_dim"], 1e-6)
        state = LinearStateSpec(1, state_shapes=gdn.state_shapes(), dtype=torch.float32)
        full = FullAttentionSpec(1, d["num_key_value_heads"], d["head_dim"], dtype)
        return tuple(full if (i + 1) % every == 0 else state for i in range(n))
    raise ValueError(f"unknown arch {arch!r}")


def layer_specs(name: str, block_size: int) -> list[KVCacheSpec | None]:
    """One spec per layer of MODELS[name] at `block_size` (None: a layer without KV)."""
    return [None if s is None else dataclasses.replace(s, block_size=block_size)
            for s in _model_specs(name)]


def describe(groups: tuple[KVCacheGroup, ...], block_size: int) -> dict[str, Any]:
    """Page bytes, per group the bytes its block fills and their share of the page, and tokens
    per GiB of attention pages beside the unpadded ideal."""
    kc = KVCacheConfig(1, groups)
    page = kc.page_bytes
    attn = [g for g in groups if isinstance(g.spec, FullAttentionSpec)]
    state = [g for g in groups if isinstance(g.spec, LinearStateSpec)]
    per_token = sum(g.bytes_per_block() for g in attn) / block_size
    tokens = GIB / page * block_size / len(attn)
    ideal = GIB / per_token
    rows = [{"kind": g.spec.kind, "layers": len(g.layer_ids), "bytes": g.bytes_per_block(),
             "use": g.bytes_per_block() / page} for g in groups]
    return {"block_size": block_size, "page_bytes": page, "num_groups": len(groups),
            "attention_groups": len(attn), "state_groups": len(state),
            "groups": rows, "min_use": min(r["use"] for r in rows),
            "tokens_per_gib": tokens, "ideal_tokens_per_gib": ideal,
            "tokens_vs_ideal": tokens / ideal}


def vllm_rule_block_size(name: str, align: int = 16) -> int:
    """The attention block size vLLM's rule gives with loomserve's dtypes: vLLM keeps one page
    per layer, so one state layer against one attention layer's rows, rounded up to `align`
    (platforms/interface.py _align_hybrid_block_size, vLLM 0.33)."""
    specs = [s for s in layer_specs(name, 1) if s is not None]
    state = max(s.bytes_per_block_per_layer() for s in specs if isinstance(s, LinearStateSpec))
    attn = max(s.bytes_per_block_per_layer() for s in specs if isinstance(s, FullAttentionSpec))
    return align * -(-state // (align * attn))


def page_report(name: str, block_size: int = 16,
                max_block_tokens: int = HYBRID_MAX_BLOCK_TOKENS) -> dict[str, Any]:
    """Before (today's rule at `block_size`) and after (size_pages) for MODELS[name]."""
    specs = layer_specs(name, block_size)
    before = describe(group_layers(specs), block_size)
    sizing = size_pages(specs, block_size, max_block_tokens)
    after = describe(group_layers(layer_specs(name, sizing.block_size), sizing.state_layers),
                     sizing.block_size)
    after["state_layers_per_group"] = sizing.state_layers
    m = MODELS[name]
    return {"model": name, "repo": m["repo"], "source": m["source"],
            "layers": sum(s is not None for s in specs), "configured_block_size": block_size,
            "max_block_tokens": max_block_tokens, "before": before, "after": after,
            "vllm_rule_block_size": vllm_rule_block_size(name)}


@dataclasses.dataclass
class _Req:
    request_id: str
    all_token_ids: list
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    session_id: str | None = None
    block_hashes: list = dataclasses.field(default_factory=list)


def manager_turn_ms(groups: tuple[KVCacheGroup, ...], turns: int = 32, tokens: int = 65536,
                    reps: int = 3, seed: int = 0) -> float:
    """Median ms of KV bookkeeping per turn (hash, hit, allocate the prompt, one decode token,
    free) over the last 8 turns of one agent session growing to `tokens` tokens, through
    loomserve's KVCacheManager with these groups (no model): what more state groups cost the
    scheduler's thread."""
    import random
    import statistics
    import time

    from loomserve.kv.cache_manager import KVCacheManager

    rng = random.Random(seed)
    seq = [rng.randrange(1000, 100000) for _ in range(tokens + turns)]
    lengths = [tokens * (t + 1) // turns for t in range(turns)]
    block = groups[0].spec.block_size
    attn = sum(isinstance(g.spec, FullAttentionSpec) for g in groups)
    n_state = len(groups) - attn
    num_blocks = attn * (tokens // block + 4) + 8 * n_state + 64
    per_turn: list[list[float]] = [[] for _ in lengths]
    for rep in range(reps):
        kv = KVCacheManager(KVCacheConfig(num_blocks, groups))
        for t, plen in enumerate(lengths):
            prompt = seq[:plen]
            t0 = time.perf_counter()
            req = _Req(f"r{rep}-{t}", prompt, plen, session_id="agent")
            hit, n_hit = kv.get_computed_blocks(req)
            if not kv.allocate_slots(req, plen - n_hit, hit, n_hit):
                raise RuntimeError("pool too small")
            req.num_computed_tokens = plen
            req.all_token_ids.append(seq[plen])
            if not kv.allocate_slots(req, 1):
                raise RuntimeError("pool too small")
            req.num_computed_tokens += 1
            kv.free(req)
            per_turn[t].append(time.perf_counter() - t0)
    return 1e3 * statistics.median(statistics.median(x) for x in per_turn[-8:])
