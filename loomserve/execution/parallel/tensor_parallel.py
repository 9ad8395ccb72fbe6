"""Tensor parallelism: how a model is built, split and loaded on one rank of N.

The scheme is Megatron's. Rank r of N builds the single-rank model from a per-rank config (every
head-shaped or intermediate-shaped size divided by N, its KV heads, a vocabulary slice of
ceil(V/N) rows), makes each sum over a split dimension one all-reduce, and loads only its slices
of each checkpoint tensor, so it holds 1/N of the weights. Norms, routers and other small
tensors load whole; a bias on a row-split output is kept on rank 0 only (zeros elsewhere), so
the all-reduce adds it once. Routers see the same x on every rank, so every rank routes alike
and no token moves between ranks.

KV heads: with num_kv_heads >= N each rank owns num_kv_heads/N of them; with fewer (GQA with
N > num_kv_heads) each rank holds the one KV head its query heads read, replicated N/kv times.
So a rank's KV page is 1/N of the single-rank page (1/kv when replicated), every rank plans the
same number of blocks from the same budget, and the driver's block ids mean the same everywhere.

A model class opts in by declaring `tp_plan`, a TPPlan, in its own body (a subclass that
changes its layers states which split it follows: a plan is not inherited). The plan names the
sizes N must divide and each layer tensor's slice; this module holds the machinery and the rules
several models share (attention q/k/v/o, SwiGLU and MoE by intermediate columns, vocabulary
rows). Two ways for a block to sum its partial outputs: Megatron's row-parallel swap
(`row_parallel`: the linear becomes a RowParallelLinear that all-reduces) or an all-reduce hook
on the block's output (`reduced_blocks`), which leaves the model's modules and parameter names
as they are. Model classes without a plan, and quantized weights, are refused at N > 1.
A decoder layer outside model.layers (an MTP layer) splits by the same plan: it is built from
the rank's config and sliced by the whole one, which `parallelize` keeps on the model.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Iterator

import torch

from loomserve.execution.layers.parallel_linear import (
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_per_rank,
)
from loomserve.execution.parallel.state import TPGroup

_LAYER = re.compile(r"^((?:model|backbone)\.layers\.\d+\.)(.*)$")


class TPPlan:
    """How one model class splits over N ranks. A subclass names divisions() and shard_layer();
    the attributes below say where the model's blocks and embedding are."""

    # model.model's input embedding (its rows split by vocabulary; checkpoint names below).
    embedding = "embed_tokens"
    vocab_weights = ("model.embed_tokens.weight", "lm_head.weight")
    # Per layer, linears swapped for RowParallelLinear (Megatron's form; their weights load
    # under `<path>.linear.`), and blocks whose output gets an all-reduce hook (where present).
    row_parallel: tuple[str, ...] = ()
    reduced_blocks: tuple[str, ...] = ()
    split_kv_heads = True  # False: the cache has no per-head rows (MLA's latent, replicated)

    def divisions(self, cfg) -> dict[str, int]:
        """The config's sizes N must divide; the rank's config holds each divided by N."""
        raise NotImplementedError

    def per_rank(self, cfg, tp: TPGroup) -> dict[str, int]:
        """Other sizes of the rank's config (ones that follow from divisions')."""
        return {}

    def shard_layer(self, rest: str, t: torch.Tensor, cfg, tp: TPGroup) -> torch.Tensor:
        """This rank's slice of one layer tensor; `rest` is its name inside the layer
        (`self_attn.q_proj.weight`)."""
        raise NotImplementedError

    def check(self, cfg, size: int) -> None:
        sizes = self.divisions(cfg)
        bad = {k: v for k, v in sizes.items() if v % size}
        kv = cfg.num_kv_heads if self.split_kv_heads else size
        if bad or (kv % size and size % kv):
            names = ", ".join(f"{k}={v}" for k, v in (bad or sizes).items())
            heads = (f", and divide or be a multiple of num_kv_heads={kv}"
                     if self.split_kv_heads else "")
            raise ValueError(f"tensor_parallel_size={size} must divide {names}{heads}")

    def shard_config(self, cfg, tp: TPGroup):
        kw = {k: v // tp.size for k, v in self.divisions(cfg).items()}
        if self.split_kv_heads:
            kw["num_kv_heads"] = kv_heads_of(tp.rank, tp.size, cfg.num_kv_heads)[1]
        kw["vocab_size"] = vocab_per_rank(cfg.vocab_size, tp.size)
        kw.update(self.per_rank(cfg, tp))
        return dataclasses.replace(cfg, **kw)

    def parallelize(self, model: torch.nn.Module, cfg, tp: TPGroup) -> None:
        inner = model.model
        for layer in inner.layers:
            self.parallelize_layer(layer, tp)
        setattr(inner, self.embedding, VocabParallelEmbedding(
            vocab_per_rank(cfg.vocab_size, tp.size), cfg.hidden_size, cfg.vocab_size, tp))
        model.tp = tp
        model.tp_whole_config = cfg  # the sizes layer_weight slices by (extra_layer_weight)

    def parallelize_layer(self, layer: torch.nn.Module, tp: TPGroup) -> None:
        """One decoder layer's communicating parts (also a layer outside model.layers, such as
        an MTP module's, which must split exactly like the model's own)."""
        for path in self.row_parallel:
            owner, _, leaf = path.rpartition(".")
            parent = layer.get_submodule(owner)
            setattr(parent, leaf, RowParallelLinear(getattr(parent, leaf), tp))
        for name in self.reduced_blocks:
            if hasattr(layer, name):
                reduce_output(getattr(layer, name), tp)

    def layer_weight(self, rest: str, t: torch.Tensor, cfg, tp: TPGroup
                     ) -> tuple[str, torch.Tensor]:
        """(name inside the parallelized layer, this rank's slice) of one layer tensor named
        `rest` inside its layer; cfg is the whole model's config."""
        t = self.shard_layer(rest, t, cfg, tp)
        for path in self.row_parallel:
            if rest.startswith(path + "."):
                rest = f"{path}.linear.{rest[len(path) + 1:]}"
        return rest, t

    def shard_weights(self, weights: Iterable[tuple[str, torch.Tensor]], cfg, tp: TPGroup
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        vocab = vocab_per_rank(cfg.vocab_size, tp.size)
        for name, t in weights:
            if name in self.vocab_weights:
                t = vocab_rows(t, tp.rank * vocab, vocab)
            else:
                m = _LAYER.match(name)
                if m:
                    layer, rest = m.groups()
                    rest, t = self.layer_weight(rest, t, cfg, tp)
                    name = layer + rest
            yield name, t.contiguous()


def plan_of(model_cls: type) -> TPPlan | None:
    """The plan the class declares in its own body (None: it declares none)."""
    return vars(model_cls).get("tp_plan")


def check_supported(model_cls: type, cfg, size: int, quantization: str) -> None:
    """Raise a clear error for what this rank split cannot serve."""
    plan = plan_of(model_cls)
    if plan is None:
        raise NotImplementedError(
            f"tensor parallelism needs a model class that declares its split (a tp_plan: "
            f"loomserve/execution/parallel/tensor_parallel.py); {model_cls.__name__} declares "
            f"none: serve it with --tensor-parallel-size 1")
    if quantization not in ("none", "auto"):  # auto keeps a split model's weights as they are
        raise NotImplementedError(f"--quantization {quantization} with --tensor-parallel-size "
                                  f"{size} is not supported yet")
    plan.check(cfg, size)


def shard_config(model_cls: type, cfg, tp: TPGroup):
    """The config a rank builds its slice of the model from."""
    return plan_of(model_cls).shard_config(cfg, tp)


def parallelize(model: torch.nn.Module, cfg, tp: TPGroup) -> None:
    """Swap in the communicating layers (on the meta device, before the weights load)."""
    plan_of(type(model)).parallelize(model, cfg, tp)


def shard_weights(model_cls: type, weights: Iterable[tuple[str, torch.Tensor]], cfg,
                  tp: TPGroup) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors -> this rank's slices, named as the parallelized model's
    load_weights expects."""
    return plan_of(model_cls).shard_weights(weights, cfg, tp)


# --- layers outside model.layers (MTP), split as the model's own ----------------------------

def parallelize_extra_layer(model: torch.nn.Module, layer: torch.nn.Module) -> None:
    """The communicating parts of `layer`, a decoder layer built from the rank's config that
    is not in model.model.layers (an MTP layer's), exactly as the model's own layers have them."""
    plan_of(type(model)).parallelize_layer(layer, model.tp)


def extra_layer_weight(model: torch.nn.Module, rest: str, t: torch.Tensor
                       ) -> tuple[str, torch.Tensor]:
    """(name inside such a layer, this rank's slice) of its tensor named `rest` inside it."""
    return plan_of(type(model)).layer_weight(rest, t, model.tp_whole_config, model.tp)


def vocab_parallel_like(model: torch.nn.Module) -> VocabParallelEmbedding:
    """A (meta) embedding split over the vocabulary as the model's own input embedding."""
    full = getattr(model.model, plan_of(type(model)).embedding)
    return VocabParallelEmbedding(full.num_embeddings, full.embedding_dim, full.vocab_size,
                                  model.tp)


def vocab_slice(model: torch.nn.Module, t: torch.Tensor) -> torch.Tensor:
    """This rank's vocabulary rows of a whole [vocab, ...] tensor (an own embedding or head)."""
    tp, vocab = model.tp, model.tp_whole_config.vocab_size
    rows = vocab_per_rank(vocab, tp.size)
    return vocab_rows(t, tp.rank * rows, rows)


# --- rules several models share ----------------------------------------------------------------

def kv_heads_of(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """(first KV head, count) rank `rank` holds (replicated when fewer heads than ranks)."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, per
    return rank // (size // num_kv_heads), 1


def vocab_rows(t: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) of t, zero rows past its end (the padding of the last rank)."""
    out = torch.zeros(rows, *t.shape[1:], dtype=t.dtype)
    got = t[start:start + rows]
    out[:got.shape[0]] = got
    return out


def reduce_output(module: torch.nn.Module, tp: TPGroup) -> None:
    """The module's output, a partial sum on each rank, summed over the ranks."""
    module.register_forward_hook(lambda _m, _args, out: tp.all_reduce(out))


def part(t: torch.Tensor, dim: int, total: int, tp: TPGroup) -> torch.Tensor:
    """Rank r's slice r of N equal slices of `total` along dim (t.shape[dim] == total * unit)."""
    per = t.shape[dim] // tp.size
    assert per * tp.size == t.shape[dim] and total % tp.size == 0, (t.shape, dim, total)
    return t.narrow(dim, tp.rank * per, per)


def bias_once(t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """A bias added after the all-reduce of a row-split output: rank 0 keeps it, others zeros."""
    return t if tp.is_driver else torch.zeros_like(t)


def attention_weight(rest: str, t: torch.Tensor, cfg, tp: TPGroup, block: str = "self_attn."
                     ) -> torch.Tensor | None:
    """q/k/v/o and sinks of an attention block, by head (q rows per head, whatever a head's rows
    are); None when `rest` is not one of them."""
    leaf = rest.split(".")[1] if rest.startswith(block) else None
    if leaf == "q_proj" or leaf == "sinks":
        return part(t, 0, cfg.num_heads, tp)
    if leaf in ("k_proj", "v_proj"):
        first, count = kv_heads_of(tp.rank, tp.size, cfg.num_kv_heads)
        d = t.shape[0] // cfg.num_kv_heads
        return t.narrow(0, first * d, count * d)
    if leaf == "o_proj":
        return bias_once(t, tp) if rest.endswith("bias") else part(t, 1, cfg.num_heads, tp)
    return None


_SWIGLU = re.compile(
    r"^mlp\.(?:(shared_experts?)\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj)\.weight$")


def swiglu_weight(rest: str, t: torch.Tensor, tp: TPGroup, inter: int, moe_inter: int = 0,
                  shared: int = 0) -> torch.Tensor:
    """SwiGLU MLPs by intermediate columns: the dense one (`inter`), every routed expert
    (`moe_inter`; per expert or stacked [experts, 2 * inter, hidden] gate; up), the shared
    expert(s) (`shared`); routers, gates and norms whole."""
    m = _SWIGLU.match(rest)
    if m:
        total = shared if m.group(1) else moe_inter if rest.startswith("mlp.experts.") else inter
        return part(t, 1 if m.group(2) == "down_proj" else 0, total, tp)
    i = moe_inter
    if rest == "mlp.experts.gate_up_proj":  # stacked [experts, 2 * inter, hidden]: gate; up
        gate, up = t.split(i, dim=1)
        return torch.cat([part(gate, 1, i, tp), part(up, 1, i, tp)], dim=1)
    if rest == "mlp.experts.down_proj":  # stacked [experts, hidden, inter]
        return part(t, 2, i, tp)
    return t
