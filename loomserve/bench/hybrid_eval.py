"""Offline replay of agentic traces through the hybrid KV cache manager (no model).

Each trace hash id becomes a block key (chained: a block's key is interned from its parent's
key and its id, per trace scope), requests run one at a time in time order: prefix lookup,
allocation of the prompt, then the output as one decode span (so the state at the last block
boundary of prompt + output is what the baseline keeps), then free. The output's blocks are
the next turn's blocks of the same agent when that turn extends this prompt (the recorded
output is part of the next prompt), else unique. Token hit rate = hit tokens / prompt tokens.

Model: Qwen3-Next-like (48 layers: 12 full attention, 2 KV heads x 256 bf16; 36 Gated DeltaNet
with a 16 x 128 x 128 fp32 state + conv), one pool with a full-attention group and a linear
state group. Capacity: the same number of pool blocks (block_size tokens each) as a
full-attention-only manager given the same capacity in tokens; the hybrid pool also spends
blocks on state pages (running, end-of-sequence, checkpoints) out of that count.
Policies: (a) baseline (end-of-sequence state only), (b) interval, (c) marconi, (d) both, each
with LRU and FLOP-aware eviction; the bound is the same replay through a full-attention-only
manager at the same capacity in tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from loomserve.bench.trace import Session
from loomserve.kv.eviction import FlopModel
from loomserve.kv.manager import KVCacheManager, RetentionConfig
from loomserve.kv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, LinearStateSpec

POLICIES = {
    "a_end_only": RetentionConfig(),
    "b_interval": RetentionConfig(interval=True),
    "c_marconi": RetentionConfig(marconi=True),
    "d_both": RetentionConfig(interval=True, marconi=True),
}
EVICTIONS = ("lru", "flop_aware")
# ~3B active parameters per token (MoE), 12 full-attention layers x 16 q heads x 256.
QWEN3_NEXT_FLOPS = FlopModel(linear_flops_per_token=2 * 3e9,
                             attn_flops_per_pair=4.0 * 12 * 16 * 256)


def qwen3_next_config(num_blocks: int, block_size: int, hybrid: bool = True) -> KVCacheConfig:
    fa = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_dim=256,
                           dtype=torch.bfloat16)
    if not hybrid:
        return KVCacheConfig(num_blocks, (KVCacheGroup(fa, tuple(range(48))),))
    gdn = LinearStateSpec(block_size=block_size,
                          state_shapes=((3 * 16 * 128, 3), (16, 128, 128)), dtype=torch.float32)
    fa_layers = tuple(range(3, 48, 4))
    gdn_layers = tuple(i for i in range(48) if i % 4 != 3)
    return KVCacheConfig(num_blocks, (KVCacheGroup(fa, fa_layers), KVCacheGroup(gdn, gdn_layers)))


class _Len:
    """Stands in for a token list: the manager only needs its length once hashes are given."""
    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class _Req:
    __slots__ = ("request_id", "all_token_ids", "num_prompt_tokens", "num_computed_tokens",
                 "cache_salt", "session_id", "block_hashes")

    def __init__(self, rid: str, n: int, hashes: list[bytes]) -> None:
        self.request_id = rid
        self.all_token_ids = _Len(n)
        self.num_prompt_tokens = n
        self.num_computed_tokens = 0
        self.cache_salt = None
        self.session_id = None
        self.block_hashes = hashes


@dataclass
class EvalRequest:
    in_tokens: int
    out_tokens: int
    hashes: list[bytes]  # keys of the full blocks of prompt + output


class Workload:
    def __init__(self, sessions: list[Session]) -> None:
        self.block_size = bs = sessions[0].block_size
        intern: dict[tuple[int, int], int] = {}
        raw = []
        for si, s in enumerate(sessions):
            by_agent: dict[str, list] = {}
            for k, r in enumerate(s.all_requests()):
                raw.append((r.t, si, k, r))
                by_agent.setdefault(r.agent, []).append(r)
            nxt = {}
            for reqs in by_agent.values():
                for a, b in zip(reqs, reqs[1:]):
                    nxt[id(a)] = b
            for _, _, _, r in raw[-len(s.all_requests()):]:
                r_next = nxt.get(id(r))
                m = len(r.hash_ids)
                total = (r.in_tokens + r.out_tokens) // bs
                ids = list(r.hash_ids)
                if total > m:
                    if r_next is not None and r_next.hash_ids[:m] == r.hash_ids:
                        ids.extend(r_next.hash_ids[m:total])
                    ids.extend(None for _ in range(total - len(ids)))  # unique blocks
                keys = []
                parent = si + 1
                for h in ids[:total] if total > m else ids:
                    if h is None:
                        parent = -(len(intern) + 1)
                        intern[(parent, 0)] = parent  # never shared
                    else:
                        parent = intern.setdefault((parent, h), len(intern) + 1)
                    keys.append(parent)
                setattr_ = keys  # noqa: F841
                r_keys = [k.to_bytes(16, "little", signed=True) for k in keys]
                self._pending = getattr(self, "_pending", {})
                self._pending[id(r)] = r_keys
        raw.sort(key=lambda x: (x[0], x[1], x[2]))
        self.requests = [EvalRequest(r.in_tokens, r.out_tokens, self._pending[id(r)])
                         for _, _, _, r in raw]
        del self._pending
        self.unique_blocks = len({h for r in self.requests for h in r.hashes})

    @property
    def working_set_tokens(self) -> int:
        return self.unique_blocks * self.block_size


def replay(w: Workload, capacity_tokens: int, hybrid: bool, retention: RetentionConfig | None,
           eviction: str = "lru", alpha: float = 1.0) -> dict:
    bs = w.block_size
    num_blocks = max(4, capacity_tokens // bs)
    kv = KVCacheManager(qwen3_next_config(num_blocks, bs, hybrid), retention=retention,
                        eviction=eviction, flop_model=QWEN3_NEXT_FLOPS, eviction_alpha=alpha)
    hit_tokens = counted = truncated = 0
    t0 = time.perf_counter()
    for i, r in enumerate(w.requests):
        req = _Req(str(i), r.in_tokens, r.hashes)
        hit, n_hit = kv.get_computed_blocks(req)
        counted += r.in_tokens
        if kv.allocate_slots(req, r.in_tokens - n_hit, hit, n_hit):
            hit_tokens += n_hit
            req.num_computed_tokens = r.in_tokens
            if r.out_tokens:
                req.all_token_ids.n += r.out_tokens
                kv.allocate_slots(req, r.out_tokens)  # if refused: end at the prompt
        else:
            truncated += 1
        kv.free(req)
    return {"hit_rate": hit_tokens / counted if counted else 0.0, "truncated": truncated,
            "num_blocks": num_blocks, "wall_s": round(time.perf_counter() - t0, 2)}


def evaluate(w: Workload, fractions, policies=POLICIES, evictions=EVICTIONS, alpha=1.0,
             log=None) -> list[dict]:
    rows = []
    ws = w.working_set_tokens
    for f in fractions:
        cap = int(ws * f)
        row = {"capacity_fraction": f, "capacity_tokens": cap}
        row["full_attention_only"] = replay(w, cap, False, None)["hit_rate"]
        for name, ret in policies.items():
            for ev in evictions:
                res = replay(w, cap, True, ret, ev, alpha)
                row[f"{name}/{ev}"] = res["hit_rate"]
        best = max(v for k, v in row.items() if "/" in k)
        row["best_over_fa"] = best / row["full_attention_only"] if row["full_attention_only"] else None
        base = min(row["a_end_only/lru"], row["a_end_only/flop_aware"])
        row["best_over_a"] = best / base if base else float("inf")
        rows.append(row)
        if log:
            log(row)
    return rows
