"""Qwen3-Next's and Qwen3.5's multi-token prediction (MTP) layer, loaded to draft for speculative
decoding.

Qwen3-Next checkpoints carry one MTP layer beside the model, under `mtp.`: pre_fc_norm_embedding,
pre_fc_norm_hidden, fc, layers.0 (a full-attention decoder layer as the model's own: gated
attention with q/k norms and partial RoPE, the sparse MoE with its gated shared expert), norm.
Embedding and LM head are the model's. As vLLM's qwen3_next_mtp computes it:

    g_p = norm(Layer(fc([pre_fc_norm_embedding(embed(t_{p+1})); pre_fc_norm_hidden(h_p)])))
    logits_p = lm_head(g_p)                                      (a guess of t_{p+2})

h_p is the model's output at p, after its final norm (vLLM's Qwen3-Next model returns it normed);
a chained draft's h_p is the previous step's g_p. Every norm is Qwen3-Next's (1 + w) one; no
position is masked. The config names no layer count (vLLM defaults to one): the layers are those
under mtp.layers.* in the checkpoint. The layer's attention is one more full-attention layer in
the model's KV group (Qwen3NextForCausalLM.kv_cache_specs); the proposer (execution/spec_mtp.py)
drives it through the interface of DeepSeek's and GLM-4.5's modules. Under tensor parallelism
its decoder layer splits as the target's layers (Qwen3NextTP); fc and the norms are whole.
transformers has no MTP code; the test reference is the formula in plain torch around
transformers' Qwen3Next decoder layer.

Qwen3.5 (dense and MoE; qwen3_5.py serves it on these classes) carries the same layer under the
same names, also in the released vision-language checkpoints (mtp.* beside model.language_model.*,
as vLLM's qwen3_5_mtp reads them): fc over [pre_fc_norm_embedding(embed); pre_fc_norm_hidden(h)],
one full-attention decoder layer of the model's kind (a dense SwiGLU for the dense models, the
sparse MoE with its gated shared expert for the MoE ones), norm, the model's embedding and head.
Its config counts the layers (text_config's mtp_num_hidden_layers: 1 in the released configs
seen). Under TP its layer splits by Qwen3_5TP (Qwen3-Next's split). The test reference is the
same formula around transformers' Qwen3.5 decoder layer.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re

import torch
from torch import nn

from loomserve.execution.models.loading.weight_layout import lm_head_argmax
from loomserve.execution.models.qwen3_next import (
    DecoderLayer,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    ZeroCenteredRMSNorm,
)
from loomserve.execution.parallel.tensor_parallel import (
    extra_layer_weight,
    parallelize_extra_layer,
)

_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


class Qwen3NextMtpLayer(nn.Module):
    """The MTP layer: its parameters bear the checkpoint's names with `mtp.` dropped and
    `mtp.layers.0.` as model.layers.0., so Qwen3NextForCausalLM's loader fills it."""

    # the model's loader, run over this module: every parameter covered once
    load_weights = Qwen3NextForCausalLM.load_weights
    _load_one = Qwen3NextForCausalLM._load_one

    def __init__(self, cfg: Qwen3NextConfig, block: DecoderLayer) -> None:
        super().__init__()
        self.config, self.lm_head = cfg, None
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([block])
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def self_attn(self) -> nn.Module:
        return self.model.layers[0].self_attn

    def forward(self, target: Qwen3NextForCausalLM, input_ids: torch.Tensor,
                positions: torch.Tensor, previous: torch.Tensor, meta) -> torch.Tensor:
        """input_ids: the token at p + 1 for each row at position p; previous: h_p. Returns
        g_p (after the MTP norm), the next step's `previous` and `logits`' input."""
        e = self.pre_fc_norm_embedding(target.model.embed_tokens(input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(previous)], dim=-1))
        cos, sin = target.rotary.lookup(positions)
        return self.norm(self.model.layers[0](x, (cos, sin, target.rotary.half), meta, None))

    def logits(self, target: Qwen3NextForCausalLM, normed: torch.Tensor) -> torch.Tensor:
        return target.compute_logits(normed)

    def greedy(self, target: Qwen3NextForCausalLM, normed: torch.Tensor) -> torch.Tensor:
        """The argmax ids of `logits`, the same on every tensor-parallel rank."""
        return lm_head_argmax(target, normed, target.lm_head, target.model.embed_tokens)


class Qwen3NextMTP(nn.Module):
    """The checkpoint's MTP layers, in order."""

    def __init__(self, layers: list[Qwen3NextMtpLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


def load_mtp(target: Qwen3NextForCausalLM, folder: str, num_nextn: int,
             dtype: torch.dtype, device: torch.device) -> Qwen3NextMTP:
    """The MTP layer of the checkpoint in `folder`, in `dtype` on `device` (num_nextn: 1, the
    one layer Qwen3-Next and Qwen3.5 ship; more would share fc and norms, as vLLM builds them).
    Raises ValueError when the checkpoint lacks it or holds more than one. Under TP each rank
    loads the slice of its decoder layer the target's plan gives (fc and the norms whole;
    embedding and head are the target's)."""
    cfg = target.config
    names = _mtp_tensor_files(folder)
    if any(n.endswith(("weight_scale_inv", "weight_scale")) for n in names):
        raise ValueError("--speculative-config: the checkpoint's MTP weights are FP8-scaled, "
                         "which the MTP drafter does not load; dequantize first")
    if "mtp.fc.weight" not in names:
        raise ValueError(f"--speculative-config: method 'mtp' needs the checkpoint's MTP "
                         f"weights, and {folder} holds no mtp.fc.weight")
    count = len({int(m.group(1)) for n in names if (m := _MTP_LAYER.match(n))})
    if count != 1 or num_nextn != 1:
        raise ValueError(f"--speculative-config: the Qwen3-Next / Qwen3.5 MTP drafter runs one "
                         f"MTP layer; {folder} holds {count} (the config says {num_nextn})")
    # Qwen3-Next's layer and Qwen3.5-MoE's are sparse, Qwen3.5's dense one is not
    moe = any(".mlp.experts." in n or n.endswith("mlp.gate.weight") for n in names)
    n = cfg.num_layers
    block_cfg = dataclasses.replace(  # the layer as layer n of the model: full attention
        cfg, layer_types=cfg.layer_types + ("full_attention",),
        mlp_only_layers=cfg.mlp_only_layers + (() if moe else (n,)))
    with torch.device("meta"):  # no time spent initializing what is loaded next
        layer = Qwen3NextMtpLayer(block_cfg, DecoderLayer(block_cfg, n))
        if target.tp is not None:
            parallelize_extra_layer(target, layer.model.layers[0])
    layer = layer.to(dtype).to_empty(device=device)
    layer.load_weights(_tensors(target, names, dtype))
    return Qwen3NextMTP([layer]).eval().requires_grad_(False)


def _mtp_tensor_files(folder: str) -> dict[str, str]:
    """{tensor name: safetensors file} of every mtp.* tensor (from the index when there is one,
    else from each file's header)."""
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            pairs = [(n, os.path.join(folder, p)) for n, p in json.load(f)["weight_map"].items()]
    else:
        pairs = []
        for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
            with safe_open(path, "pt") as f:
                pairs.extend((n, path) for n in f.keys())
    return {n: p for n, p in pairs if n.startswith("mtp.")}


def _tensors(target: Qwen3NextForCausalLM, files: dict[str, str], dtype: torch.dtype):
    """(name as Qwen3NextMtpLayer's, tensor in `dtype`; under TP the decoder layer's the rank's
    slice) for each of `files`' tensors."""
    from safetensors import safe_open

    for path in sorted(set(files.values())):
        with safe_open(path, "pt") as f:
            for name in sorted(n for n, p in files.items() if p == path):
                rest, t = name[len("mtp."):], f.get_tensor(name)
                if rest.startswith("layers.0."):
                    inner = rest[len("layers.0."):]
                    if target.tp is not None:
                        inner, t = extra_layer_weight(target, inner, t)
                    rest = "model.layers.0." + inner
                yield rest, t.to(dtype).contiguous()
