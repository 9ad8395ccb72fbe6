"""The engine core: schedule, run, postprocess. Token ids in, token ids out.

It owns the scheduler (control plane), the KV cache manager (data plane) and the model runner
(execution plane) and is driven by exactly one thread. With KV tiers configured, a TierConnector
(data plane, loomserve.kv.connector) sits beside the KV manager: the scheduler asks it about
waiting requests, the step offers freshly computed blocks to it after the forward pass and
polls it once per step; its I/O runs on the tier store's threads. Text (detokenization, stop strings)
lives in the front end, off this loop, as in vLLM v1.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from loomserve.config import EngineConfig
from loomserve.execution.messages import EngineStats
from loomserve.execution.model_runner import ModelRunner
from loomserve.execution.request import Request, RequestStatus
from loomserve.execution.scheduler import Scheduler
from loomserve.kv.cache_manager import KVCacheManager
from loomserve.kv.connector import (
    TierConnector,
    build_tiered_store,
    model_identity,
    tiers_supported,
)
from loomserve.kv.eviction import FlopModel
from loomserve.kv.retention import RetentionConfig
from loomserve.kv.spec import LinearStateSpec

log = logging.getLogger("loomserve.execution")


@dataclass
class CoreOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    num_tier_cached_tokens: int = 0


def make_tier_connector(config: EngineConfig, runner: ModelRunner, kv: KVCacheManager
                        ) -> TierConnector | None:
    """The KV tiers the config asks for, connected to the pool; None when off or unsupported."""
    if not config.tier.enabled:
        return None
    if not config.cache.enable_prefix_caching:
        log.warning("KV tiers need prefix caching; tiers disabled")
        return None
    if not tiers_supported(runner.kv_cache_config):
        kinds = sorted({g.spec.kind for g in runner.kv_cache_config.groups})
        log.warning("KV tiers disabled: no tier support for one of this model's layer kinds "
                    "(%s)", ", ".join(kinds))
        return None
    store = build_tiered_store(config.tier, runner.kv_cache_config.page_bytes)
    model_id = model_identity(runner.model_name, getattr(runner, "model_folder", None))
    log.info("KV tiers: %s", " -> ".join(t.name for t in store.tiers))
    return TierConnector(kv, store, runner.kv_buffer, model_id, config.tier.tier_max_inflight)


def retention_config(config: EngineConfig) -> RetentionConfig:
    c = config.cache
    return RetentionConfig(interval="interval" in c.retention, every_n_tokens=c.checkpoint_every,
                           marconi="marconi" in c.retention,
                           max_checkpoints_per_path=c.max_checkpoints_per_path,
                           pin_ttl_s=c.session_pin_ttl, pin_budget_bytes=c.session_pin_budget)


def flop_model(runner: ModelRunner) -> FlopModel:
    """FLOPs to recompute a prefix: 2 per parameter per token, plus the quadratic attention term
    of the attention layers (what FLOP-aware eviction weighs a block or checkpoint by)."""
    mc = runner.model_config
    attn_layers = sum(len(g.layer_ids) for g in runner.kv_cache_config.groups
                      if not isinstance(g.spec, LinearStateSpec))
    return FlopModel(linear_flops_per_token=2.0 * runner.num_params,
                     attn_flops_per_pair=4.0 * attn_layers * mc.num_heads * mc.head_dim)


class EngineCore:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        self.runner = runner or ModelRunner(config)
        self.kv = KVCacheManager(self.runner.kv_cache_config,
                                 enable_caching=config.cache.enable_prefix_caching,
                                 retention=retention_config(config), eviction=config.cache.eviction,
                                 flop_model=flop_model(self.runner))
        self.tiers = make_tier_connector(config, self.runner, self.kv)
        sc = config.scheduler
        self.scheduler = Scheduler(self.kv, sc.max_num_batched_tokens, sc.max_num_seqs,
                                   sc.long_prefill_threshold, self.tiers)
        capacity = self.runner.kv_cache_config.capacity_tokens
        if capacity < config.cache.block_size:
            raise ValueError("the KV cache holds less than one block: raise --kv-cache-memory")
        max_len = config.model.max_model_len
        if max_len and max_len > capacity:
            raise ValueError(f"--max-model-len {max_len} exceeds the KV cache capacity "
                             f"of {capacity} tokens: raise --kv-cache-memory")
        # A request must fit in the pool alone, or preemption could never make room for it.
        self.max_model_len = min(self.runner.max_model_len, capacity)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.last_step_seconds = 0.0

    def add_request(self, req: Request) -> None:
        self.scheduler.add(req)
        self.prompt_tokens += req.num_prompt_tokens

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(req, status)
        return True

    def end_session(self, session_id: str) -> None:
        """The agent session is over: release its pinned blocks and its prefix-hash memo."""
        self.kv.end_session(session_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[CoreOutput]:
        t0 = time.perf_counter()
        tiers = self.tiers
        if tiers is not None:
            tiers.poll()
        sched = self.scheduler.schedule()
        sampled = self.runner.execute(sched.model_input).sampled if sched.model_input.seqs else {}
        if tiers is not None:
            tiers.after_execute()
            if not sched.model_input.seqs:
                tiers.wait_io(0.005)  # only tier I/O is pending: do not spin
        outputs = []
        for req, tokens in self.scheduler.update(sched, sampled):
            self.generation_tokens += len(tokens)
            done = req.status.finished
            outputs.append(CoreOutput(req.request_id, tokens, done,
                                      req.status.value if done else None, req.num_cached_tokens,
                                      req.num_tier_cached_tokens))
        self.last_step_seconds = time.perf_counter() - t0
        return outputs

    def attach_tiers(self, store, max_inflight: int | None = None) -> TierConnector:
        """Connect a ready-made TieredStore (e.g. with custom tiers) to this engine's pool."""
        if self.tiers is not None:
            raise RuntimeError("this engine already has KV tiers")
        runner = self.runner
        model_id = model_identity(runner.model_name, getattr(runner, "model_folder", None))
        self.tiers = TierConnector(self.kv, store, runner.kv_buffer, model_id,
                                   max_inflight or self.config.tier.tier_max_inflight)
        self.scheduler.tiers = self.tiers
        return self.tiers

    def idle(self) -> None:
        """No request to run: release finished tier writes and start due prefetches."""
        if self.tiers is not None:
            self.tiers.poll()

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
            self.scheduler.tiers = None

    def stats(self) -> EngineStats:
        kv = self.kv
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            kv_blocks_total=kv.num_blocks,
            prefix_queried_tokens=kv.stats.prefix_queried_tokens,
            prefix_hit_tokens=kv.stats.prefix_hit_tokens,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_hit_tokens_by_source=(
                self.tiers.hit_tokens_by_source()
                if self.tiers is not None else {"device": kv.stats.prefix_hit_tokens}),
            tiers=self.tiers.stats() if self.tiers is not None else {},
        )
