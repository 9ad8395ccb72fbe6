"""GLM-4.5's multi-token prediction (MTP) layer, loaded to draft for speculative decoding.

GLM-4.5 / 4.6 checkpoints carry num_nextn_predict_layers (1) MTP layers past the model's own, at
model.layers.{N + i} (N = num_hidden_layers): enorm, hnorm, eh_proj, shared_head.norm,
shared_head.head, sometimes embed_tokens (absent: the model's), and a decoder layer as the
model's own (GQA with the q/k/v bias, q/k norms and partial RoPE; the MoE of layer N + i), its
tensors named as a decoder layer's at that index:

    g_p = shared_head.norm(DecoderLayer(eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)])))
    logits_p = shared_head.head(g_p)                            (a guess of t_{p+2})

h_p is the model's output at p, its final hidden state *after* the final norm: what vLLM's and
SGLang's GLM-4.5 MTP (written with Zhipu) are fed, their model's forward returning it normed. A
chained draft's h_p is the previous step's g_p, normed as well: GLM's NextN normalizes at the end
of every step (as vllm-project/vllm#46075 describes it; vLLM's DeepSeek path does so since #45895,
SGLang's deepseek_nextn always did); deepseek_mtp.py feeds DeepSeek's modules alike. The embedding
at position 0 is zeroed, as vLLM does.

The layer's attention is one more full-attention layer in the model's KV group
(Glm4MoeForCausalLM.kv_cache_specs); the proposer (execution/spec_mtp.py) drives it through the
interface DeepSeek's modules have: `model.mtp.layers[i](model, ids, positions, previous, meta)`
returns the next step's `previous` (here g), `.logits(model, g)` its logits. transformers has
no MTP code; the test reference is the formula in plain torch around transformers' Glm4Moe
decoder layer. Under tensor parallelism the layer splits as the target's layers (Glm4MoeTP):
heads and expert columns split, an own embedding or head by vocabulary rows, the rest whole.
"""

from __future__ import annotations

import torch
from torch import nn

from loomserve.execution.models.deepseek_mtp import NextNParts, layer_tensors, mtp_layer_files
from loomserve.execution.models.glm4_moe import (
    Glm4MoeConfig,
    Glm4MoeDecoderLayer,
    Glm4MoeForCausalLM,
    load_checkpoint,
)
from loomserve.execution.parallel.tensor_parallel import (
    parallelize_extra_layer,
    vocab_parallel_like,
)


class Glm4MoeMtpLayer(NextNParts, Glm4MoeDecoderLayer):
    """One MTP layer: the decoder layer at model.layers.{N + i} with the MTP parts beside its
    blocks, so every parameter bears the checkpoint's name under that prefix. embed_tokens and
    the head fall back to the target model's when the checkpoint has none of its own."""

    def __init__(self, cfg: Glm4MoeConfig, index: int, own_embed: bool, own_head: bool):
        super().__init__(cfg, index)
        self.add_nextn_parts(cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps, cfg,
                             own_embed, own_head)

    def forward(self, target: Glm4MoeForCausalLM, input_ids: torch.Tensor,
                positions: torch.Tensor, previous: torch.Tensor, meta) -> torch.Tensor:
        """input_ids: the token at p + 1 for each row at position p; previous: h_p. Returns
        g_p (after shared_head.norm), the next step's `previous` and `logits`' input."""
        x = self.block_input(target, input_ids, positions, previous)
        cos, sin = target.rotary.lookup(positions)
        return self.shared_head.norm(super().forward(x, (cos, sin, target.rotary.half), meta))


class Glm4MoeMTP(nn.Module):
    """The checkpoint's MTP layers, in order (layer i predicts i + 2 tokens ahead)."""

    def __init__(self, layers: list[Glm4MoeMtpLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


class _AsLayerZero(nn.Module):
    """`layer` named model.layers.0 of a model with `config`: how load_checkpoint sees it."""

    def __init__(self, config: Glm4MoeConfig, layer: Glm4MoeMtpLayer) -> None:
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([layer])


def load_mtp(target: Glm4MoeForCausalLM, folder: str, num_nextn: int,
             dtype: torch.dtype, device: torch.device) -> Glm4MoeMTP:
    """The MTP layers of the checkpoint in `folder`, in `dtype` on `device`. Raises ValueError
    when the checkpoint lacks them or holds FP8-scaled MTP weights. Under TP each rank loads
    its slice, split as the target's layers (deepseek_mtp.py's rank_slice)."""
    cfg = target.config
    layers = []
    for i, (pre, mine) in enumerate(mtp_layer_files(
            folder, cfg.num_layers, num_nextn, ("weight_scale_inv", "weight_scale"), "FP8-scaled")):
        with torch.device("meta"):  # no time spent initializing what is loaded next
            layer = Glm4MoeMtpLayer(cfg, cfg.num_layers + i, pre + "embed_tokens.weight" in mine,
                                    pre + "shared_head.head.weight" in mine)
            if target.tp is not None:
                parallelize_extra_layer(target, layer)  # the layer is its own decoder layer
                if layer.embed_tokens is not None:
                    layer.embed_tokens = vocab_parallel_like(target)
        layer = layer.to(dtype).to_empty(device=device)
        load_checkpoint(_AsLayerZero(cfg, layer), _tensors(target, mine, pre, dtype))
        layers.append(layer)
    return Glm4MoeMTP(layers).eval().requires_grad_(False)


def _tensors(target: Glm4MoeForCausalLM, files: dict[str, str], pre: str, dtype: torch.dtype):
    """(name under model.layers.0., tensor in `dtype`; under TP the rank's slice) for each of
    `files`' tensors under pre."""
    for _, rest, t in layer_tensors(target, files, pre):
        yield "model.layers.0." + rest, t.to(dtype).contiguous()
