"""KV tiers under --async-scheduling (engine/step_overlap.py; kv/connector/stores.py, loads.py).

Oracle: the synchronous engine with the same tiers, and the step order itself. A multi-turn
agent workload on a device pool too small for its sessions (warm turns load from the host tier;
turns finish while others prefill; a request aborted with its step in flight) gives the
synchronous engine's greedy tokens, with tier hits. A guard on the tier store checks every call
that copies device rows against the step in flight: a store never copies a row that step
writes, a load never writes a row that step reads or writes (it fails without the deferrals).
Afterwards no block, tier reference or load remains.
"""

from __future__ import annotations

import functools
import os
import random
import time

import pytest

from loomserve import LLM, SamplingParams
from loomserve.engine.messages import EngineCoreRequest
from loomserve.kv.hashing import hash_chain
from tests.execution.conftest import FIXTURES

BS = 16
POOL_BLOCKS = 16  # the device pool: room for about three sessions' turns of the workload
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


@functools.lru_cache(maxsize=None)
def page_bytes(name: str) -> int:
    probe = LLM(os.path.join(FIXTURES, name), dtype="float32", block_size=BS,
                kv_cache_memory="1MiB")
    try:
        return probe.core.runner.kv_cache_config.page_bytes
    finally:
        probe.close()


def make(async_scheduling: bool, name: str = "tiny-llama", **tiers) -> LLM:
    pb = page_bytes(name)
    tiers = tiers or {"host_cache_memory": str(pb * 256)}
    llm = LLM(os.path.join(FIXTURES, name), dtype="float32", block_size=BS,
              async_scheduling=async_scheduling, kv_cache_memory=str(pb * POOL_BLOCKS), **tiers)
    llm.free_at_start = llm.core.kv.num_free_blocks
    return llm


def rows_in_flight(core, written_only: bool) -> set[int]:
    """Rows of the step in flight in its token groups (attention): those it writes (its
    tokens' positions), or every row its sequences read as well."""
    pending = core.overlap._pending if core.overlap is not None else None
    if pending is None:
        return set()
    out, bs = set(), core.kv.block_size
    groups = [g for g, token in enumerate(core.kv.token_block_groups) if token]
    for s in pending[0].model_input.seqs:
        lo = s.start_pos // bs if written_only else 0
        hi = (s.start_pos + len(s.token_ids) - 1) // bs + 1
        for g in groups:
            out.update(s.block_ids[g][lo:hi])
    return out


class StepOrderGuard:
    """Records each tier store call that touches device rows the step in flight writes (a
    store's copy-out) or reads or writes (a load's copy-in), and how many ran beside a step."""

    def __init__(self, core, monkeypatch) -> None:
        self.clashes: list[tuple[str, set[int]]] = []
        self.beside_a_step = {"offer": 0, "store": 0, "load_async": 0}
        store = core.tiers.store
        for name, written_only in (("offer", True), ("store", True), ("load_async", False)):
            monkeypatch.setattr(store, name, self._spy(core, name, getattr(store, name),
                                                       written_only))

    def _spy(self, core, name, fn, written_only):
        def spy(keys, src, rows=None):
            busy = rows_in_flight(core, written_only)
            if busy:
                self.beside_a_step[name] += 1
            if rows is not None and busy & set(rows):
                self.clashes.append((name, busy & set(rows)))
            return fn(keys, src, rows)
        return spy


def settle(llm) -> None:
    """Wait for the tier writes, then release the rows they held: nothing may remain."""
    core = llm.core
    for _ in range(3):  # an idle poll offers the checkpoints hashed when the last turn ended
        assert core.tiers.store.flush(10)
        core.idle()
    assert core.tiers.num_held_blocks == 0 and core.tiers.num_inflight == 0
    assert not core.has_work() and not core.scheduler.requests
    assert core.kv.num_free_blocks == llm.free_at_start


def request(rid: str, prompt: list[int], session: str | None = None,
            sampling: SamplingParams = GREEDY) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                             max_tokens=sampling.max_tokens, session_id=session)


def run_sessions(llm, sessions: int = 4, turns: int = 3) -> tuple[dict, int]:
    """Agent sessions, a turn each per round, arriving two steps apart (a turn finishes while
    another prefills); each turn resends the session's context plus its output and 20 new
    tokens. In the second round a stray request is aborted after two steps (with async
    scheduling, while its step is in flight). Returns each turn's tokens and the tier-served
    prompt tokens."""
    core = llm.core
    context = {s: tokens(s, 60 + 7 * s) for s in range(sessions)}
    out: dict[str, list[int]] = {}
    tier_tokens = 0
    for turn in range(turns):
        arrivals = [(2 * s, request(f"s{s}-t{turn}", context[s], f"s{s}"))
                    for s in range(sessions)]
        if turn == 1:
            arrivals.insert(1, (1, request("stray", tokens(99, 50))))
        step = 0
        while arrivals or core.has_work():
            while arrivals and arrivals[0][0] <= step:
                assert core.add(arrivals.pop(0)[1]) is None
            if turn == 1 and step == 3:
                assert core.abort("stray")
                assert core.overlap is None or core.overlap.in_flight
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    tier_tokens += o.num_tier_cached_tokens
            step += 1
        for s in range(sessions):
            context[s] = context[s] + out[f"s{s}-t{turn}"] + tokens(100 * turn + s, 20)
    out.pop("stray", None)  # how far an aborted request got depends on the step timing
    return out, tier_tokens


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-next"])  # + Gated DeltaNet state
def test_multi_turn_sessions_on_a_small_pool_match_the_synchronous_engine(name, monkeypatch):
    plain, overlapped = make(False, name), make(True, name)
    try:
        guard = StepOrderGuard(overlapped.core, monkeypatch)
        want, plain_tier = run_sessions(plain)
        got, tier = run_sessions(overlapped)
        assert got == want
        assert plain_tier > 0 and tier > 0, (plain_tier, tier)  # warm turns came from the tier
        assert not guard.clashes, guard.clashes
        assert guard.beside_a_step["offer"] and guard.beside_a_step["load_async"]
        settle(plain)
        settle(overlapped)
    finally:
        plain.close()
        overlapped.close()


def test_load_claiming_an_aborted_requests_rows_waits_for_its_step(tmp_path, monkeypatch):
    """A warm turn's load (disk tier) claims rows at schedule time right after a request was
    aborted with its row in the step in flight: the freed block at the front of the free queue
    is that row's. The load writes only after that step; the warm turn's tokens are the cold
    ones."""
    llm = make(True, disk_cache_dir=str(tmp_path / "kv"),
               disk_cache_size=str(page_bytes("tiny-llama") * 256))
    core = llm.core
    try:
        guard = StepOrderGuard(core, monkeypatch)
        claimed_busy = []  # rows each claim took that the step in flight then wrote

        def claim(keep, num_new, _f=core.kv.claim_pages):
            pages = _f(keep, num_new)
            claimed_busy.append({b.block_id for b in pages or ()} & rows_in_flight(core, True))
            return pages
        monkeypatch.setattr(core.kv, "claim_pages", claim)
        warm = tokens(1, 100)
        cold = llm.generate(warm, GREEDY)[0].token_ids
        for seed in range(10, 14):  # other traffic pushes warm's blocks out of the pool
            llm.generate(tokens(seed, 100), GREEDY)
        settle(llm)
        assert not any(h in core.kv.pool.cached[0] for h in hash_chain(warm, BS)[:2])
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        assert core.add(request("b", tokens(7, 20), sampling=long)) is None
        for _ in range(3):
            core.step()
        assert core.add(request("w", warm)) is None
        core.step()  # w's tier lookup starts
        assert core.tiers.loads.pending["w"].handle.wait(10)
        assert core.abort("b") and core.overlap.in_flight  # b's row is in the step in flight
        core.step()  # w claims rows, b's among them
        assert core.tiers.loads.pending["w"].phase == "load"
        out, tier = [], 0
        deadline = time.monotonic() + 30
        while core.has_work() and time.monotonic() < deadline:
            for o in core.step():
                if o.request_id == "w":
                    out += o.new_token_ids
                    tier = o.num_tier_cached_tokens if o.finished else tier
        assert out == cold
        assert tier == 6 * BS  # every full block but the last prompt token's
        assert claimed_busy and claimed_busy[0], claimed_busy  # the hazard was there
        assert not guard.clashes, guard.clashes
        settle(llm)
    finally:
        llm.close()
