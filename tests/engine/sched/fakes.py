"""Small, honest stand-ins for what the scheduler talks to: the KV manager, the model runner
and the tier connector. Each records its calls so tests can say what the scheduler asked for.

FakeKV keeps the facade's contract as far as the scheduler uses it (loomserve.kv.cache_manager):
a fixed pool of blocks, ceil(tokens / block_size) blocks per request, all-or-nothing
allocation, hits capped at prompt length - 1 and block aligned, probes only while a request
holds no block. It does not share blocks between requests: a hit takes pool blocks like a fresh
allocation (the real pool charges a hit on a free cached block too), which only makes the fake
stricter about capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

from loomserve.engine.sched.request import Request
from loomserve.engine.sched.scheduler import Scheduler, SchedulerOutput
from loomserve.execution.batch import ModelInput, ModelOutput
from loomserve.kv.cache_manager import KVCacheStats
from loomserve.kv.connector import FULL, GO, WAIT
from loomserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class FakeHit:
    request_id: str
    num_tokens: int


class FakeKV:
    has_state_groups = False

    def __init__(self, num_blocks: int, block_size: int = 4, enable_caching: bool = True,
                 log: list | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.stats = KVCacheStats()
        self.blocks: dict[str, list[int]] = {}  # request id -> block ids it holds
        self._free = list(range(num_blocks - 1, -1, -1))
        self._prefixes: set[tuple[int, ...]] = set()
        self.calls: list[tuple] = [] if log is None else log

    def cache_prefix(self, token_ids: list[int]) -> None:
        """Make every whole-block prefix of token_ids a hit from now on."""
        bs = self.block_size
        for b in range(1, len(token_ids) // bs + 1):
            self._prefixes.add(tuple(token_ids[:b * bs]))

    def hit_length(self, tokens: list[int]) -> int:
        """Longest cached whole-block prefix of tokens, capped at len(tokens) - 1."""
        bs = self.block_size
        if self.enable_caching:
            for b in range((len(tokens) - 1) // bs, 0, -1):
                if tuple(tokens[:b * bs]) in self._prefixes:
                    return b * bs
        return 0

    def held(self, request_id: str) -> int:
        return len(self.blocks.get(request_id, ()))

    @property
    def num_held(self) -> int:
        return sum(len(b) for b in self.blocks.values())

    def get_computed_blocks(self, req: Request, record_stats: bool = True) -> tuple[FakeHit, int]:
        assert self.held(req.request_id) == 0, "probe while holding blocks"
        self.calls.append(("get_computed_blocks", req.request_id))
        tokens = req.all_token_ids
        n = self.hit_length(tokens)
        if record_stats:
            self.stats.prefix_queried_tokens += len(tokens)
            self.stats.prefix_hit_tokens += n
        return FakeHit(req.request_id, n), n

    def refresh_prefix(self, req: Request) -> int:
        """No recency order here (prefixes never evict): nothing to refresh, nothing logged."""
        return 0

    def allocate_slots(self, req: Request, num_new_tokens: int, hit: FakeHit | None = None,
                       num_hit_tokens: int = 0) -> bool:
        rid, bs = req.request_id, self.block_size
        if hit is not None:
            assert hit == FakeHit(rid, num_hit_tokens) and self.held(rid) == 0
        assert num_hit_tokens % bs == 0 and num_new_tokens >= 0
        total = req.num_computed_tokens + num_hit_tokens + num_new_tokens
        assert total <= req.num_tokens, "slots past the request's tokens"
        need = -(-total // bs) - self.held(rid)
        ok = need <= len(self._free)
        self.calls.append(("allocate_slots", rid, num_new_tokens, num_hit_tokens, ok))
        if ok:
            self.blocks.setdefault(rid, []).extend(self._free.pop() for _ in range(need))
        return ok

    def free(self, req: Request, release: str | None = None) -> None:
        self.calls.append(("free", req.request_id))
        self._free.extend(reversed(self.blocks.pop(req.request_id, [])))

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        return [self.blocks.setdefault(request_id, [])]


class FakeRunner:
    """Samples one token per seq with sample=True: token_fn(seq), by default a function of the
    position it is sampled for, so recomputation after a preemption samples the same tokens."""

    def __init__(self, block_size: int = 4, token_fn=None) -> None:
        self.block_size = block_size
        self.token_fn = token_fn or (lambda seq: 100 + (seq.start_pos + len(seq.token_ids)) % 50)
        self.inputs: list[ModelInput] = []
        self.finished: list[str] = []

    def execute(self, model_input: ModelInput) -> ModelOutput:
        self.inputs.append(model_input)
        self.finished.extend(model_input.finished_request_ids)
        for s in model_input.seqs:
            assert s.token_ids, "a seq with nothing to compute"
            assert len(s.block_ids[0]) * self.block_size >= s.start_pos + len(s.token_ids)
        return ModelOutput({s.request_id: self.token_fn(s) for s in model_input.seqs if s.sample})


class FakeConnector:
    """A TierConnector whose prepare() verdict per request id is set by the test (default GO)."""

    def __init__(self, log: list | None = None, tier_tokens: int = 0) -> None:
        self.verdicts: dict[str, str] = {}
        self.tier_tokens = tier_tokens
        self.calls: list[tuple] = [] if log is None else log

    def on_add(self, req: Request) -> None:
        self.calls.append(("on_add", req.request_id))

    def prepare(self, req: Request) -> str:
        self.calls.append(("prepare", req.request_id))
        verdict = self.verdicts.get(req.request_id, GO)
        assert verdict in (GO, WAIT, FULL)
        return verdict

    def on_admit(self, req: Request, num_hit_tokens: int, count: bool = True) -> int:
        self.calls.append(("on_admit", req.request_id, num_hit_tokens, count))
        return min(self.tier_tokens, num_hit_tokens)

    def on_finish(self, req: Request, aborted: bool) -> None:
        self.calls.append(("on_finish", req.request_id, aborted))


def make_request(rid: str, prompt: list[int] | int, max_tokens: int = 4,
                 eos: frozenset[int] = frozenset()) -> Request:
    if isinstance(prompt, int):
        base = sum(map(ord, rid))
        prompt = [(base + i) % 50 for i in range(prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens, eos)


def step(sched: Scheduler, runner: FakeRunner
         ) -> tuple[SchedulerOutput, list[tuple[Request, list[int]]]]:
    """One engine step as EngineCore.step does it: schedule, run (if anything), update."""
    out = sched.schedule()
    sampled = runner.execute(out.model_input).sampled if out.model_input.seqs else {}
    return out, sched.update(out, sampled)


def scheduled(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]
