"""Model registry: HF `architectures` (or `model_type`) -> model class; the runner's model contract.

One line per architecture (MODELS): its HF name, its HF model_type, and its class as a lazy
"module:Class" path, so a model's module is imported only when a checkpoint asks for it; an
entry whose module is not there is skipped as if unregistered. A plugin calls `register()`.
Everything else a model is (its config parsing, its tensor-parallel split, which parallel modes
it supports) is declared in its own file, on its class.

The contract a model class implements (the runner calls nothing else):

    cls.config_class  (optional)      a class with from_hf(hf_config_dict) -> config; else the
                                      registry's CONFIGS entry; else ArchConfig. The config
                                      needs vocab_size, max_position_embeddings, eos_token_ids.
    cls.tp_plan       (optional)      its tensor-parallel split (parallel/tensor_parallel.py)
    cls.supports_dcp, cls.supports_tp_dcp (optional)
                                      decode context parallelism verified (without / with TP:
                                      parallel/context_parallel.py). These three are read from
                                      the class's own body: a subclass declares its own.
    cls(config)                       built on the meta device, then .to(dtype).to_empty(device)
    load_weights(iter of (HF name, tensor))
    init_rotary(max_positions, device, dtype)    after the weights: derived tables (RoPE)
    kv_cache_specs(block_size, dtype) -> list[KVCacheSpec | None]
                                      one per cache entry: by default one per layer, in layer
                                      order; None for a layer that keeps no cache (an MLP-only
                                      layer). A model may return more entries than layers (a
                                      layer keeping two caches of different kinds, e.g.
                                      DeepSeek-V3.2's indexer-key entries after its latent
                                      rows'); then it must define kv_cache_modules of the same
                                      length, and its forward maps layers to entries.
                                      Linear-state specs choose their own dtype (fp32 state in
                                      a bf16 model is fine).
    kv_cache_modules() (optional) -> list[nn.Module | None]
                                      the module that owns each entry's cache; default: the
                                      first of layer.self_attn / .linear_attn / .mixer that has
                                      a `k_cache` or `state_cache` attribute, over
                                      model.model.layers
    set_layer_groups(groups)          group id per spec entry (None where the spec was None)

    forward(input_ids, positions, attn_meta, state_batch) -> hidden [tokens, hidden]
        input_ids, positions: [tokens], the step's tokens flattened, decode rows first, then
            prefill chunks (the rows AttentionMetadata and StateSeq refer to).
        attn_meta: list indexed by KV group id; AttentionMetadata for attention groups (full or
            sliding: the window is in the metadata), None for state groups.
        state_batch: list indexed by KV group id; loomserve.execution.layers.state.StateBatch for
            linear-state groups, None for attention groups. StateDirective page copies/zeroing have
            already happened when forward runs.
    compute_logits(hidden [rows, hidden]) -> logits [rows, vocab] (softcapping included)

Before the first step the runner binds each cache module (after set_layer_groups):
    attention: .k_cache, .v_cache   [num_blocks, block_size, kv_heads, head_dim] (spec dtype)
    linear state: .state_cache      tuple of [num_blocks, *shape], one per spec.state_shapes
                                    entry (spec dtype); page p of every view lies in pool page p
Group ids follow the runner's order: full attention groups first, then sliding window, then
linear state; within a kind, by first layer. Layers with equal specs share a group.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from loomserve.execution.models.arch_config import ArchConfig

_M = "loomserve.execution.models"
# (HF architecture, its HF model_type, the class that serves it)
MODELS = (
    ("LlamaForCausalLM", "llama", f"{_M}.llama:LlamaForCausalLM"),
    ("MistralForCausalLM", "mistral", f"{_M}.llama:LlamaForCausalLM"),
    ("Qwen2ForCausalLM", "qwen2", f"{_M}.llama:LlamaForCausalLM"),
    ("Qwen3ForCausalLM", "qwen3", f"{_M}.llama:LlamaForCausalLM"),
    ("Gemma3ForCausalLM", "gemma3_text", f"{_M}.gemma3:Gemma3ForCausalLM"),
    ("GptOssForCausalLM", "gpt_oss", f"{_M}.gpt_oss:GptOssForCausalLM"),
    ("Qwen3MoeForCausalLM", "qwen3_moe", f"{_M}.qwen3_moe:Qwen3MoeForCausalLM"),
    ("Qwen3NextForCausalLM", "qwen3_next", f"{_M}.qwen3_next:Qwen3NextForCausalLM"),
    ("Qwen3_5ForCausalLM", "qwen3_5_text", f"{_M}.qwen3_5:Qwen3_5ForCausalLM"),
    ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", f"{_M}.qwen3_5:Qwen3_5ForCausalLM"),
    # the released vision-language checkpoints: their text model only (qwen3_5.py)
    ("Qwen3_5ForConditionalGeneration", "qwen3_5", f"{_M}.qwen3_5:Qwen3_5ForCausalLM"),
    ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", f"{_M}.qwen3_5:Qwen3_5ForCausalLM"),
    ("NemotronHForCausalLM", "nemotron_h", f"{_M}.nemotron_h:NemotronHForCausalLM"),
    ("DeepseekV3ForCausalLM", "deepseek_v3", f"{_M}.deepseek_v3:DeepseekV3ForCausalLM"),
    ("DeepseekV32ForCausalLM", "deepseek_v32", f"{_M}.deepseek_v32:DeepseekV32ForCausalLM"),
    ("Glm4MoeForCausalLM", "glm4_moe", f"{_M}.glm4_moe:Glm4MoeForCausalLM"),
    ("MiniMaxM2ForCausalLM", "minimax_m2", f"{_M}.minimax_m2:MiniMaxM2ForCausalLM"),
    ("KimiLinearForCausalLM", "kimi_linear", f"{_M}.kimi_linear:KimiLinearForCausalLM"),
)
ARCHITECTURES: dict[str, str] = {arch: target for arch, _, target in MODELS}
# model_type -> architecture, for configs without `architectures`.
MODEL_TYPES: dict[str, str] = {mtype: arch for arch, mtype, _ in MODELS}
# Config classes of (plugin) models that do not name one as `config_class` (default: ArchConfig).
CONFIGS: dict[str, str] = {}


def register(architecture: str, target: str | type, model_type: str | None = None,
             config: str | type | None = None) -> None:
    """Add or replace an entry; target (and config) is a class or a lazy "module:Class" path."""
    ARCHITECTURES[architecture] = _path(target)
    if config is not None:
        CONFIGS[architecture] = _path(config)
    if model_type:
        MODEL_TYPES[model_type] = architecture


def _path(target: str | type) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def _load(target: str) -> type | None:
    module, _, name = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:  # the model's file is not there; a broken import inside it is a bug
            return None
        raise
    return getattr(mod, name)


def supported_architectures() -> list[str]:
    return [a for a, t in ARCHITECTURES.items()
            if importlib.util.find_spec(t.partition(":")[0]) is not None]


def resolve(hf: dict[str, Any]) -> tuple[type, Any]:
    """(model class, parsed config) for an HF config.json dict."""
    archs = list(hf.get("architectures") or [])
    if not archs and hf.get("model_type") in MODEL_TYPES:
        archs = [MODEL_TYPES[hf["model_type"]]]
    for arch in archs:
        cls = _load(ARCHITECTURES[arch]) if arch in ARCHITECTURES else None
        if cls is not None:
            config_cls = getattr(cls, "config_class", None)
            if config_cls is None and arch in CONFIGS:
                config_cls = _load(CONFIGS[arch])
            return cls, (config_cls or ArchConfig).from_hf(hf)
    raise ValueError(f"unsupported architecture {archs or hf.get('model_type')!r}; "
                     f"supported: {supported_architectures()}")
