"""Qwen3.5 (text), dense and MoE: Qwen3-Next's hybrid served by its classes (qwen3_next.py).

transformers' qwen3_5 / qwen3_5_moe text models are Qwen3-Next's layers with three differences,
all checked against transformers:
- the Gated DeltaNet's input projections are separate (in_proj_qkv with rows [q | k | v], in_proj_z,
  in_proj_b, in_proj_a) instead of Qwen3-Next's per-key-head interleaved in_proj_qkvz / in_proj_ba
  (layers/gated_deltanet.py reads both);
- dense: every layer's MLP is a SwiGLU of intermediate_size (no experts); MoE: every layer's is
  the sparse MoE with a sigmoid-gated shared expert, its router always renormalizing the top k;
- RoPE is multimodal (mrope_section over t/h/w positions); for text the three position axes are
  equal, where it is Qwen3-Next's partial RoPE.

Checkpoints: the released ones are the vision-language Qwen3_5ForConditionalGeneration /
Qwen3_5MoeForConditionalGeneration (config.json's text_config; weights model.language_model.*,
model.visual.*, lm_head, mtp.*). Only the text causal LM is served: its config is read from
text_config, its weights renamed to model.*, the vision tower and the MTP layer skipped (for
`"method": "mtp"` drafts qwen3_next_mtp.py loads the MTP layer, as Qwen3-Next's). A flat
Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM checkpoint loads as it is.

Tensor parallelism: Qwen3-Next's split (Qwen3NextTP), on the renamed weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator

import torch

from loomserve.execution.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM, Qwen3NextTP
from loomserve.execution.parallel.state import TPGroup

_TEXT_PREFIX = "model.language_model."
_SKIPPED = ("model.visual.", "mtp.")


@dataclasses.dataclass(frozen=True)
class Qwen3_5Config(Qwen3NextConfig):
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Qwen3_5Config":
        text = text_config(d)
        moe = "moe" in str(text.get("model_type", ""))
        if moe:  # the router always renormalizes; every layer is sparse
            if not int(text.get("num_experts") or 0):
                raise ValueError("a qwen3_5_moe config needs num_experts > 0")
            text.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        else:  # dense: no experts whatever the dict carries
            text.update(num_experts=0)
        cfg = super().from_hf(text)
        return dataclasses.replace(cfg, linear_split_projections=True)


def text_config(d: dict[str, Any]) -> dict[str, Any]:
    """The text model's config.json fields: a vision-language config's text_config over its top
    level (the top level's tie_word_embeddings wins: the LM head is the wrapper's), or d itself."""
    inner = d.get("text_config")
    if not isinstance(inner, dict):
        return dict(d)
    top = {k: v for k, v in d.items() if k not in ("text_config", "vision_config")}
    out = {**top, **inner}
    if "tie_word_embeddings" in d:
        out["tie_word_embeddings"] = d["tie_word_embeddings"]
    return out


def text_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's text-model tensors under the flat causal LM's names: model.language_model.*
    -> model.*; the vision tower and the MTP head dropped."""
    for name, t in weights:
        if name.startswith(_SKIPPED):
            continue
        if name.startswith(_TEXT_PREFIX):
            name = "model." + name[len(_TEXT_PREFIX):]
        yield name, t


class Qwen3_5TP(Qwen3NextTP):
    """Qwen3-Next's split of the renamed text weights."""

    def shard_weights(self, weights: Iterable[tuple[str, torch.Tensor]], cfg: Qwen3_5Config,
                      tp: TPGroup) -> Iterator[tuple[str, torch.Tensor]]:
        return super().shard_weights(text_weights(weights), cfg, tp)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5's text causal LM, dense or MoE (the config says which)."""

    config_class = Qwen3_5Config
    tp_plan = Qwen3_5TP()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(text_weights(weights))
