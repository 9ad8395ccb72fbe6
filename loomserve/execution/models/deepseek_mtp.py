"""DeepSeek-V3's multi-token prediction (MTP) modules, loaded to draft for speculative decoding.

DeepSeek-V3 / R1 checkpoints carry num_nextn_predict_layers MTP modules past the model's own
layers, at model.layers.{N + i} (N = num_hidden_layers): enorm, hnorm, eh_proj, a full decoder
layer (MLA, then MoE or a dense MLP as layer N + i would have), shared_head.norm, shared_head.head
and sometimes embed_tokens (absent: the model's own, as in most releases). Module i at position p
takes a hidden state h_p and the token at p + 1:

    g_p = shared_head.norm(DecoderLayer(eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)])))
    logits_p = shared_head.head(g_p)                            (a guess of t_{p+2})

Which h_p: for the first module, the model's output at p, its final hidden state *after* the
final norm; for a chained draft, the previous step's g_p, after shared_head.norm. That is what
the serving engines feed DeepSeek's modules: vLLM's proposer passes the target's returned hidden
states (DeepseekV2Model.forward ends in self.norm), and its DeepSeekMultiTokenPredictorLayer
returns (pre-norm for the logits, shared_head.norm of it to recycle) since
vllm-project/vllm#45895 (read in vLLM 0.33's deepseek_mtp.py); SGLang's deepseek_nextn takes
the hidden states its logits processor saw (post-norm) and ends every step in shared_head.norm;
AMD's ATOM, whose first step already took the post-norm state, moved its chained steps to g
(ROCm/ATOM#1764), citing the checkpoint-side modeling_deepseek.py (the main model's forward
ends in self.norm and that tensor is the MTP's previous_hidden_states), and measured DeepSeek-R1
acceptance going from 61.4% to 64.6% (3 drafts). The three families here (GLM-4.5, Qwen3-Next
too) take h_p so. The embedding at position 0 is zeroed, as vLLM and SGLang do.

Each module's attention keeps its own latent rows: one more MLA layer in the model's KV group
(DeepseekV3ForCausalLM.kv_cache_specs). DeepSeek-V3.2's module is the same around a V3.2 decoder
layer (the target's `decoder_layer`: sparse MLA with a lightning indexer of its own), whose
latent rows and indexer keys are one more layer in each of V3.2's two kinds of group
(deepseek_v32.py). transformers has no MTP code; the test reference is the formula above in
plain torch around transformers' decoder layer, DeepseekV3's or DeepseekV32's
(tests/fixtures/build_mla_fixture.py: mtp_reference).

Tensor parallelism: on a rank of N (target.tp set) the module is that rank's slice, split by
the target's own plan (DeepseekV3TP): its decoder layer is built from the rank's config and
gets the layer's all-reduce hooks and tensor slices, exactly as model.layers.i does (MLA heads
and kv_b_proj rows split, the latent path and so the cache rows replicated, MoE by columns);
enorm, hnorm, eh_proj and shared_head.norm are whole; an own embed_tokens or shared_head.head
holds the rank's vocabulary rows, as the target's. `greedy` gives every rank the same ids.
GLM-4.5's layer (glm4_moe_mtp.py) shares SharedHead and rank_slice; the split itself is
tensor_parallel.py's (parallelize_extra_layer, extra_layer_weight), Qwen3-Next's too.
"""

from __future__ import annotations

import glob
import json
import os
import re

import torch
from torch import nn

from loomserve.execution.layers.moe import DeepseekMoE
from loomserve.execution.layers.norm import RMSNorm
from loomserve.execution.models.deepseek_v3 import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    copy_into,
    load_mlp_weight,
)
from loomserve.execution.models.loading.weight_layout import lm_head_argmax, lm_head_logits
from loomserve.execution.parallel.tensor_parallel import (
    extra_layer_weight,
    parallelize_extra_layer,
    vocab_parallel_like,
    vocab_slice,
)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
# names inside model.layers.{N + i} that belong to the decoder layer itself
_BLOCK = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")


class SharedHead(nn.Module):
    """The MTP module's final norm and LM head (None: the target's); the GLM-4.5 layer's too."""

    def __init__(self, cfg, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if own_head else None

    def logits(self, target: nn.Module, normed: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] of g (under TP: on rank 0, the sampler's; a slice elsewhere)."""
        if self.head is None:
            return target.compute_logits(normed)
        if target.tp is not None:  # the rank's vocabulary rows: joined as the target's are
            return lm_head_logits(target, normed, self.head, target.model.embed_tokens)
        return self.head(normed)

    def greedy(self, target: nn.Module, normed: torch.Tensor) -> torch.Tensor:
        """The argmax ids of `logits`, the same on every tensor-parallel rank (each rank feeds
        them to the next chained draft)."""
        if target.tp is None:
            return self.logits(target, normed).argmax(dim=-1)
        head = target.lm_head if self.head is None else self.head
        return lm_head_argmax(target, normed, head, target.model.embed_tokens)


class NextNParts:
    """What a DeepSeek-style MTP (NextN) layer holds beside its decoder block, and how it
    uses them: enorm, hnorm, eh_proj, an optional own embed_tokens and the shared head
    (GLM-4.5's layer is built the same way around its own block)."""

    def add_nextn_parts(self, hidden: int, vocab: int, eps: float, cfg, own_embed: bool,
                        own_head: bool) -> None:
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.embed_tokens = nn.Embedding(vocab, hidden) if own_embed else None
        self.shared_head = SharedHead(cfg, own_head)

    def block_input(self, target: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                    previous: torch.Tensor) -> torch.Tensor:
        """eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)]), the embedding zeroed at position 0."""
        embed = target.model.embed_tokens if self.embed_tokens is None else self.embed_tokens
        e = embed(input_ids).masked_fill((positions == 0).unsqueeze(-1), 0.0)
        return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(previous)], dim=-1))

    def logits(self, target: nn.Module, normed: torch.Tensor) -> torch.Tensor:
        return self.shared_head.logits(target, normed)

    def greedy(self, target: nn.Module, normed: torch.Tensor) -> torch.Tensor:
        return self.shared_head.greedy(target, normed)


class MtpLayer(NextNParts, nn.Module):
    """One MTP module; embed and head fall back to the target model's when the checkpoint
    has none of its own."""

    def __init__(self, cfg: DeepseekV3Config, block: nn.Module, own_embed: bool, own_head: bool):
        super().__init__()
        self.add_nextn_parts(cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps, cfg,
                             own_embed, own_head)
        # layer N + i as the target's family builds it (MoE where DeepSeek puts it; V3.2:
        # sparse MLA with a lightning indexer of its own)
        self.block = block

    def forward(self, target: DeepseekV3ForCausalLM, input_ids: torch.Tensor,
                positions: torch.Tensor, previous: torch.Tensor, meta) -> torch.Tensor:
        """input_ids: the token at p + 1 for each row at position p; previous: h_p (normed).
        Returns g_p (after shared_head.norm): `logits`' input and the next step's `previous`."""
        x = self.block_input(target, input_ids, positions, previous)
        cos, sin = target.rotary.lookup(positions)
        return self.shared_head.norm(self.block(x, (cos, sin, target.rotary.half), meta))


class DeepseekMTP(nn.Module):
    """The checkpoint's MTP modules, in order (module i predicts i + 2 tokens ahead)."""

    def __init__(self, layers: list[MtpLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


def mtp_tensor_names(folder: str, num_layers: int) -> dict[str, str]:
    """{tensor name: safetensors file} of every tensor at layer index >= num_layers (read from
    the index when there is one, else from each file's header)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = json.load(f)["weight_map"].items()
        pairs = [(n, os.path.join(folder, f)) for n, f in names]
    else:
        from safetensors import safe_open
        pairs = []
        for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
            with safe_open(path, "pt") as f:
                pairs.extend((n, path) for n in f.keys())
    out = {}
    for name, path in pairs:
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= num_layers:
            out[name] = path
    return out


def load_mtp(target: DeepseekV3ForCausalLM, folder: str, num_nextn: int,
             dtype: torch.dtype, device: torch.device) -> DeepseekMTP:
    """The MTP modules of the checkpoint in `folder`, in `dtype` on `device`. Raises
    ValueError when the checkpoint lacks them or holds FP8 block-scaled MTP weights."""
    cfg = target.config
    layers = []
    for i, (pre, mine) in enumerate(mtp_layer_files(folder, cfg.num_layers, num_nextn,
                                                    ("weight_scale_inv",), "FP8 block-scaled")):
        with torch.device("meta"):  # no time spent initializing what is loaded next
            layer = MtpLayer(cfg, target.decoder_layer(cfg, cfg.num_layers + i),
                             pre + "embed_tokens.weight" in mine,
                             pre + "shared_head.head.weight" in mine)
            if target.tp is not None:
                _parallelize(target, layer)
        layer = layer.to(dtype).to_empty(device=device)
        _load_layer(target, layer, pre, mine)
        layers.append(layer)
    return DeepseekMTP(layers).eval().requires_grad_(False)


def mtp_layer_files(folder: str, num_layers: int, num_nextn: int, scale_suffixes: tuple,
                    scaled: str) -> list[tuple[str, dict[str, str]]]:
    """(prefix model.layers.{N + i}., its tensors' names -> files) per MTP layer. Raises
    ValueError when a tensor ends in one of scale_suffixes (`scaled` names that format) or a
    layer has no eh_proj."""
    names = mtp_tensor_names(folder, num_layers)
    if any(n.endswith(scale_suffixes) for n in names):
        raise ValueError(f"--speculative-config: the checkpoint's MTP weights are {scaled}, "
                         "which the MTP drafter does not load; dequantize first")
    out = []
    for i in range(num_nextn):
        pre = f"model.layers.{num_layers + i}."
        mine = {n: p for n, p in names.items() if n.startswith(pre)}
        if pre + "eh_proj.weight" not in mine:
            raise ValueError(f"--speculative-config: method 'mtp' needs the checkpoint's MTP "
                             f"weights, and {folder} holds no {pre}eh_proj.weight "
                             f"(num_nextn_predict_layers is {num_nextn})")
        out.append((pre, mine))
    return out


def layer_tensors(target: nn.Module, files: dict[str, str], pre: str):
    """(name, name under pre, tensor; under TP the rank's slice) of files' tensors, file by
    file, each once."""
    from safetensors import safe_open

    for path in sorted(set(files.values())):
        with safe_open(path, "pt") as f:
            for name in sorted(n for n, p in files.items() if p == path):
                rest, t = name[len(pre):], f.get_tensor(name)
                if target.tp is not None:
                    rest, t = rank_slice(target, rest, t)
                yield name, rest, t


def _parallelize(target: DeepseekV3ForCausalLM, layer: MtpLayer) -> None:
    """The rank's communicating parts of `layer` (built from the rank's config): the decoder
    layer's as the target's layers have them, an own embedding over the vocabulary slice."""
    parallelize_extra_layer(target, layer.block)
    if layer.embed_tokens is not None:
        layer.embed_tokens = vocab_parallel_like(target)


def rank_slice(target: nn.Module, rest: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(name inside an MTP module, this rank's slice) of one of its tensors under TP: an own
    embedding or head by vocabulary rows, the decoder layer's (_BLOCK) by the target's plan,
    the rest (enorm, hnorm, eh_proj, shared_head.norm) whole."""
    if rest in ("embed_tokens.weight", "shared_head.head.weight"):
        return rest, vocab_slice(target, t)
    if not rest.startswith(_BLOCK):
        return rest, t
    return extra_layer_weight(target, rest, t)


def _load_layer(target: DeepseekV3ForCausalLM, layer: MtpLayer, pre: str,
                files: dict[str, str]) -> None:
    """Every parameter of `layer` from its tensors (named under `pre`; under TP the rank's
    slices), exactly once."""
    params = dict(layer.named_parameters())
    expected = {n + s for n in params if n.endswith("gate_up_proj.weight") for s in ("#0", "#1")}
    expected |= {n for n in params if not n.endswith(("gate_up_proj.weight", "mlp.experts_gate_up",
                                                      "mlp.experts_down"))}
    if isinstance(layer.block.mlp, DeepseekMoE):
        expected |= {f"block.mlp.{k}" for k in layer.block.mlp.expected_keys()}
    seen: list[str] = []
    for name, rest, t in layer_tensors(target, files, pre):
        t = t.contiguous()
        if rest.startswith(_BLOCK):
            t = target.deinterleaved(rest, t)
            keys = load_mlp_weight(layer.block, "block.", rest, name, t)
            seen.extend(keys if keys is not None else [copy_into(params, "block." + rest, t)])
        else:
            seen.append(copy_into(params, rest, t))
    missing = expected - set(seen)
    dup = {n for n in seen if seen.count(n) > 1}
    if missing or dup:
        raise ValueError(f"MTP weights under {pre}: missing {sorted(missing)[:5]}, "
                         f"duplicated {sorted(dup)[:5]}")
