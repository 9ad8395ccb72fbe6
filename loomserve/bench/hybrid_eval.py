"""Offline replay of agentic traces through the hybrid KV cache manager (no model).

Each trace hash id becomes a block key (chained: a block's key is interned from its parent's
key and its id, per trace scope), requests run one at a time in time order: prefix lookup,
allocation of the prompt, then the output as one decode span (so the state at the last block
boundary of prompt + output is what the baseline keeps), then free. The output's blocks are
either the next turn's recorded blocks (echo_outputs: the output reappears verbatim in the next
prompt) or unique blocks (the model's tokens never recur, as in a served replay or when the
client re-renders the answer). Token hit rate = hit tokens / prompt tokens.

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
from loomserve.kv.cache_manager import KVCacheManager, RetentionConfig
from loomserve.kv.eviction import FlopModel
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
    """The traces as a time-ordered list of requests with chained block keys.

    echo_outputs says what a request's generated tokens become in the next turn of the same
    agent. True: the recorded next prompt's blocks after this prompt (the output reappears
    verbatim, so the state at the end of prompt + output is exactly where the next turn hits).
    False: unique blocks, never seen again. That is what a served replay does (the model's
    tokens differ from the recorded ones) and what clients that re-render or strip the previous
    answer (thinking blocks, reformatted tool calls) do; there the state kept at a sequence's
    end is never at a boundary a later request reaches.
    """

    def __init__(self, sessions: list[Session], echo_outputs: bool = True) -> None:
        self.block_size = sessions[0].block_size
        self.echo_outputs = echo_outputs
        self._intern: dict[tuple[int, int], int] = {}
        timed = []
        for si, s in enumerate(sessions):
            reqs = s.all_requests()
            following = self._next_turns(reqs)
            for k, r in enumerate(reqs):
                timed.append(((r.t, si, k), EvalRequest(r.in_tokens, r.out_tokens,
                                                        self._keys(si, r, following.get(id(r))))))
        timed.sort(key=lambda x: x[0])
        self.requests = [r for _, r in timed]
        self.unique_blocks = len({h for r in self.requests for h in r.hashes})

    @staticmethod
    def _next_turns(reqs) -> dict[int, object]:
        by_agent: dict[str, list] = {}
        for r in reqs:
            by_agent.setdefault(r.agent, []).append(r)
        return {id(a): b for turns in by_agent.values() for a, b in zip(turns, turns[1:])}

    def _keys(self, scope: int, r, r_next) -> list[bytes]:
        m = len(r.hash_ids)
        total = max(m, (r.in_tokens + r.out_tokens) // self.block_size)
        ids: list[int | None] = list(r.hash_ids)
        if self.echo_outputs and r_next is not None and tuple(r_next.hash_ids[:m]) == tuple(r.hash_ids):
            ids.extend(r_next.hash_ids[m:total])
        ids.extend([None] * (total - len(ids)))  # blocks no later request shares
        keys, parent = [], scope + 1
        for h in ids:
            if h is None:
                parent = -(len(self._intern) + 1)
                self._intern[(parent, 0)] = parent
            else:
                parent = self._intern.setdefault((parent, h), len(self._intern) + 1)
            keys.append(parent.to_bytes(16, "little", signed=True))
        return keys

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
            "num_blocks": num_blocks, "evictions": kv.pool.eviction_epoch,
            "wall_s": round(time.perf_counter() - t0, 2)}


def evaluate(w: Workload, fractions, policies=POLICIES, evictions=EVICTIONS, alpha=1.0,
             log=None) -> list[dict]:
    rows = []
    ws = w.working_set_tokens
    for f in fractions:
        cap = int(ws * f)
        row = {"capacity_fraction": f, "capacity_tokens": cap}
        row["full_attention_only"] = replay(w, cap, False, None)["hit_rate"]
        skipped = []
        for name, ret in policies.items():
            no_eviction = None
            for ev in evictions:
                if no_eviction is not None and ev != "lru":
                    # Nothing was evicted under LRU: the eviction policy never chose, so every
                    # policy replays the same (unhashed free blocks are reused first by all).
                    row[f"{name}/{ev}"] = no_eviction
                    skipped.append(f"{name}/{ev}")
                    continue
                res = replay(w, cap, True, ret, ev, alpha)
                row[f"{name}/{ev}"] = res["hit_rate"]
                if ev == "lru" and res["evictions"] == 0:
                    no_eviction = res["hit_rate"]
        if skipped:
            row["same_as_lru_no_eviction"] = skipped
        best = max(v for k, v in row.items() if "/" in k and isinstance(v, float))
        row["best_over_fa"] = best / row["full_attention_only"] if row["full_attention_only"] else None
        base = min(row["a_end_only/lru"], row["a_end_only/flop_aware"])
        row["best_over_a"] = best / base if base else float("inf")
        rows.append(row)
        if log:
            log(row)
    return rows
