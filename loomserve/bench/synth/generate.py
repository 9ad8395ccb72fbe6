"""The synthesizer's session model: one Weka-format session drawn from a `SynthProfile`.

* Main agent: T turns. The first request carries the system prompt + tools + first user message
  (`first_context` tokens). Between two requests of an agent the context grows by `growth`
  tokens (output, tool results, user text): exactly the new prefill an ideal cache sees. When
  the next context would pass the session's window (`context_limits`), it is compacted: the
  system prompt blocks are kept and a fresh summary of `compaction_summary` tokens follows.
* Hash ids: one per full block_size-token block of the input (the partial last block is
  unhashed), allocated per session from 1 and chained: a request's ids are the previous
  request's ids of the same agent plus new ids for the blocks that changed.
* Subagent groups: in a `p_subagents` fraction of sessions, `groups` groups follow distinct
  parent turns, with `group_size` subagents started a few seconds apart. A fresh subagent starts
  from its type's system prompt (ids shared by all subagents of that type in the session) plus
  its task prompt; a forked one (`--forked-subagents`) from the parent's context at the fork
  point. With probability `p_joined` the parent's next turn waits for the group.
* Timing: t is session time (subagents too); api_time = `api_base` + new prefill /
  `prefill_tps` + out / `decode_tps`; an agent's next request starts at t + api_time + think.

Invariants: session i depends only on (seed, i), not on how many sessions are drawn; the same
seed writes byte-identical files (stable key order, fixed float rounding).
"""

from __future__ import annotations

import json
import os

import numpy as np

from loomserve.bench.stats import StatsAccumulator
from loomserve.bench.synth.profiles import SynthProfile
from loomserve.bench.trace import parse_session

__all__ = ["generate_session_doc", "generate_sessions", "write_traces"]


class _Ids:
    def __init__(self):
        self.next = 1

    def take(self, n: int) -> list[int]:
        a = self.next
        self.next += n
        return list(range(a, a + n))


def _r(x: float, nd: int) -> float:
    return round(float(x), nd)


class _Agent:
    """A growing context: token count and the ids of its full blocks."""

    def __init__(self, ids: list[int], tokens: int, bs: int):
        self.ids = ids
        self.tokens = tokens
        self.bs = bs

    def grow(self, n: int, alloc: _Ids) -> None:
        self.tokens += n
        keep = len(self.ids)
        want = self.tokens // self.bs
        if want > keep:
            self.ids.extend(alloc.take(want - keep))

    def reset(self, prefix_ids: list[int], prefix_tokens: int, extra: int, alloc: _Ids) -> None:
        self.ids = list(prefix_ids)
        self.tokens = prefix_tokens
        self.grow(extra, alloc)


def _api(prof: SynthProfile, new: int, out: int) -> float:
    return prof.api_base + new / prof.prefill_tps + out / prof.decode_tps


def generate_session_doc(prof: SynthProfile, seed: int, index: int,
                         forked_fraction: float = 0.0) -> dict:
    """One session as a Weka-format JSON object (a dict in the file's key order)."""
    ss = np.random.SeedSequence([int(seed), int(index)])
    rng = np.random.default_rng(ss)
    bs = prof.block_size
    alloc = _Ids()
    n_turns = int(prof.turns.sample_int(rng, lo=1))
    limits = [w for _, w in prof.context_limits]
    probs = np.array([p for p, _ in prof.context_limits], dtype=np.float64)
    window = limits[int(rng.choice(len(limits), p=probs / probs.sum()))]
    sys_tok = int(prof.system_tokens.sample_int(rng, lo=bs))
    first = max(int(prof.first_context.sample_int(rng, lo=1)), sys_tok + 1)
    sys_ids = alloc.take(sys_tok // bs)
    ctx = _Agent(list(sys_ids), sys_tok, bs)
    ctx.grow(first - sys_tok, alloc)

    # main-agent token counts and gaps
    growth = prof.growth.sample_int(rng, n_turns, lo=1)
    outs = prof.out_tokens.sample_int(rng, n_turns, lo=1)
    thinks = prof.think_time.sample(rng, n_turns)
    summaries = prof.compaction_summary.sample_int(rng, n_turns, lo=1)

    # subagent groups: after which parent turns
    group_after: list[int] = []
    if n_turns >= 2 and rng.random() < prof.p_subagents:
        n_groups = int(min(prof.groups.sample_int(rng, lo=1), n_turns - 1))
        group_after = sorted(int(x) for x in rng.choice(n_turns - 1, n_groups, replace=False))
    sizes = np.array([s for s, _ in prof.group_size])
    weights = np.array([w for _, w in prof.group_size], dtype=np.float64)
    weights /= weights.sum()

    entries: list[dict] = []
    type_prefix: dict[str, tuple[list[int], int]] = {}
    running_ends: list[float] = []
    t = 0.0
    prev_end = next_t = 0.0
    prev_in = 0
    prev_ids = 0
    n_agents = 0
    totals = {"parent": [0, 0], "sub": [0, 0]}
    for k in range(n_turns):
        if k > 0:
            g = int(growth[k])
            if ctx.tokens + g > window:  # compaction: keep the system prompt, new summary
                ctx.reset(sys_ids, sys_tok, int(summaries[k]), alloc)
            else:
                ctx.grow(g, alloc)
        new_tokens = ctx.tokens - min(prev_ids, len(ctx.ids)) * bs if k else ctx.tokens
        out = int(outs[k])
        api = _r(_api(prof, max(new_tokens, 0), out), 2)
        if k > 0:  # think_time is the whole gap since the previous turn's end (Weka convention)
            t_new = _r(next_t + thinks[k], 3)
            think = _r(t_new - prev_end, 3)
            t = t_new
        else:
            think = 0.0
        entries.append({"t": t, "type": "s" if rng.random() < 0.1 else "n", "model": prof.model,
                        "in": ctx.tokens, "out": out, "hash_ids": list(ctx.ids),
                        "input_types": ["text"], "output_types": ["text"],
                        "stop": "end_turn" if k == n_turns - 1 else "tool_use",
                        "api_time": api, "think_time": think})
        totals["parent"][0] += ctx.tokens
        totals["parent"][1] += out
        prev_ids = len(ctx.ids)
        prev_in = ctx.tokens
        turn_end = t + api
        prev_end = turn_end
        next_t = turn_end  # earliest start of the next turn, before its own think time

        while group_after and group_after[0] == k:
            group_after.pop(0)
            size = int(rng.choice(sizes, p=weights))
            start = turn_end
            running = sum(1 for e in running_ends if e > start)
            size = min(size, prof.max_concurrent - running)
            if size <= 0:
                continue
            group_end = start
            for _ in range(size):
                n_agents += 1
                start = start + float(prof.stagger.sample(rng))
                stype = prof.subagent_types[int(rng.integers(len(prof.subagent_types)))]
                n_req = int(prof.subagent_requests.sample_int(rng, lo=1))
                task = int(prof.subagent_task.sample_int(rng, lo=1))
                if forked_fraction > 0 and rng.random() < forked_fraction:
                    sa = _Agent(list(ctx.ids), prev_in, bs)
                    sa.grow(task, alloc)
                    stype_used = "fork"
                else:
                    if stype not in type_prefix:
                        st = int(prof.subagent_system.sample_int(rng, lo=bs))
                        type_prefix[stype] = (alloc.take(st // bs), st)
                    pids, ptok = type_prefix[stype]
                    sa = _Agent(list(pids), ptok, bs)
                    sa.grow(task, alloc)
                    stype_used = stype
                sg = prof.subagent_growth.sample_int(rng, n_req, lo=1)
                so = prof.subagent_out.sample_int(rng, n_req, lo=1)
                sth = prof.subagent_think.sample(rng, n_req)
                st_t = _r(start, 3)
                tt = st_t
                reqs = []
                sprev = 0
                for j in range(n_req):
                    think_j = 0.0
                    if j > 0:
                        sa.grow(int(sg[j]), alloc)
                        think_j = _r(sth[j], 3)
                        prev = reqs[-1]
                        tt = _r(prev["t"] + prev["api_time"] + think_j, 3)
                    new = sa.tokens - sprev * bs
                    sprev = len(sa.ids)
                    a = _r(_api(prof, new, int(so[j])), 2)
                    reqs.append({"t": tt, "type": "n", "model": prof.subagent_model,
                                 "in": sa.tokens, "out": int(so[j]), "hash_ids": list(sa.ids),
                                 "input_types": ["text"], "output_types": ["text"],
                                 "stop": "end_turn" if j == n_req - 1 else "tool_use",
                                 "api_time": a, "think_time": think_j})
                    totals["sub"][0] += sa.tokens
                    totals["sub"][1] += int(so[j])
                end = reqs[-1]["t"] + reqs[-1]["api_time"]
                group_end = max(group_end, end)
                running_ends.append(end)
                entries.append({"t": st_t, "type": "subagent", "agent_id": f"agent_{n_agents:03d}",
                                "subagent_type": stype_used,
                                "duration_ms": _r((end - st_t) * 1000.0, 1),
                                "status": "completed", "models": [prof.subagent_model],
                                "requests": reqs})
            if rng.random() < prof.p_joined:
                next_t = max(next_t, group_end)
    doc = {
        "id": f"synth-{prof.name}-{seed}-{index:04d}",
        "models": [prof.model] + ([prof.subagent_model] if n_agents else []),
        "block_size": bs,
        "hash_id_scope": "local",
        "system_tokens": sys_tok,
        "requests": entries,
        "totals": {
            "parent_tokens": {"input": totals["parent"][0], "output": totals["parent"][1]},
            "subagent_tokens": {"input": totals["sub"][0], "output": totals["sub"][1]},
            "subagent_count": n_agents,
        },
        "synth": {"profile": prof.name, "seed": int(seed), "index": int(index),
                  "forked_subagents": float(forked_fraction)},
    }
    return doc


def _dumps(doc: dict) -> str:
    return json.dumps(doc, separators=(",", ":"))


def generate_sessions(prof: SynthProfile, n: int, seed: int, forked_fraction: float = 0.0):
    """Yield (doc, Session) for sessions 0..n-1 (the Session parsed back from the doc)."""
    for i in range(n):
        doc = generate_session_doc(prof, seed, i, forked_fraction)
        yield doc, parse_session(doc, f"<synth {i}>")


def write_traces(prof: SynthProfile, n: int, seed: int, out_dir: str,
                 forked_fraction: float = 0.0, progress=None) -> dict:
    """Write trace_0000.json ... into out_dir; returns the measured statistics (stats.py)."""
    os.makedirs(out_dir, exist_ok=True)
    acc = StatsAccumulator()
    for i in range(n):
        doc = generate_session_doc(prof, seed, i, forked_fraction)
        path = os.path.join(out_dir, f"trace_{i:04d}.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(_dumps(doc))
        acc.add(parse_session(doc, path))
        if progress:
            progress(i + 1, n)
    return acc.result()
