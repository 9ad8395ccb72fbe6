"""`loomserve bench synth`: generate Weka-format traces whose statistics match a target profile.

    loomserve bench synth --profile agentx --sessions N --seed S --out DIR
                          [--forked-subagents FRACTION] [--json]

Model of one session (every distribution comes from the SynthProfile):

* Main agent: T turns. The first request carries the session's system prompt + tools + first
  user message (`first_context` tokens). Between two consecutive requests of an agent the context
  grows by `growth` tokens (previous output, tool results, user text), which is exactly the new
  prefill an ideal cache sees. A session draws a context window from `context_limits`; when the
  next context would pass it, the conversation is compacted: the system prompt blocks are kept
  and a fresh summary of `compaction_summary` tokens follows (new hash ids).
* Hash ids: one id per full block_size-token block of the input (partial last block unhashed,
  as in the shipped Weka traces); ids are allocated per session from 1 and chained: a request's
  ids are the previous request's ids of the same agent plus new ids for the blocks that changed.
* Subagent groups: in a `p_subagents` fraction of sessions, `groups` groups are placed after
  distinct parent turns; a group has `group_size` subagents started a few seconds apart. A fresh
  subagent starts from its type's system prompt (ids shared by all subagents of that type in the
  session, as in the Weka corpus) plus its own task prompt; a forked one (`--forked-subagents`)
  starts from the parent's context at the fork point (the ids of the parent turn the group
  follows) plus the task prompt. With probability `p_joined` the parent's next turn waits for the
  group (starts after the group's end); otherwise it keeps its own pace and the group runs in
  the background.
* Timing: t is session time (subagent request times too: session-absolute convention);
  api_time = `api_base` + new prefill / `prefill_tps` + out / `decode_tps`; the next request of
  an agent starts at t + api_time + think_time.

Reproducible: session i is drawn from SeedSequence(seed).spawn(i + 1)[i] regardless of N, and the
same seed writes byte-identical files (stable key order, fixed float rounding).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

from loomserve.bench.stats import StatsAccumulator, summarize
from loomserve.bench.trace import Session, parse_session

__all__ = ["Dist", "SynthProfile", "PROFILES", "generate_session_doc", "generate_sessions",
           "write_traces", "compare", "add_arguments", "main"]


@dataclass(frozen=True)
class Dist:
    """A distribution given by quantiles: ((prob, value), ...) with prob from 0 to 1.

    Sampling inverts the piecewise CDF, interpolating log-linearly between points (linearly when
    a value is <= 0), so a large sample reproduces every listed quantile.
    """
    points: tuple[tuple[float, float], ...]

    def __post_init__(self):
        ps = [p for p, _ in self.points]
        vs = [v for _, v in self.points]
        if ps[0] != 0.0 or ps[-1] != 1.0 or ps != sorted(ps) or vs != sorted(vs):
            raise ValueError(f"bad quantile table {self.points}")

    def sample(self, rng: np.random.Generator, size=None):
        u = rng.random(size)
        ps = np.array([p for p, _ in self.points])
        vs = np.array([v for _, v in self.points], dtype=np.float64)
        i = np.clip(np.searchsorted(ps, u, side="right") - 1, 0, len(ps) - 2)
        lo, hi = vs[i], vs[i + 1]
        f = (u - ps[i]) / np.maximum(ps[i + 1] - ps[i], 1e-12)
        pos = (lo > 0) & (hi > 0)
        out = np.where(pos, np.exp(np.log(np.where(pos, lo, 1)) * (1 - f)
                                   + np.log(np.where(pos, hi, 1)) * f),
                       lo + (hi - lo) * f)
        return out

    def sample_int(self, rng, size=None, lo: int = 0):
        return np.maximum(np.rint(self.sample(rng, size)).astype(np.int64), lo)


def D(*points) -> Dist:
    return Dist(tuple((float(p), float(v)) for p, v in points))


@dataclass(frozen=True)
class SynthProfile:
    name: str
    description: str
    block_size: int
    model: str
    subagent_model: str
    turns: Dist                    # main-agent requests per session
    first_context: Dist            # tokens of the first main request
    system_tokens: Dist            # of which the system prompt + tools (kept through compaction)
    growth: Dist                   # main context growth between turns (= new prefill)
    out_tokens: Dist               # main-agent output tokens
    think_time: Dist               # main-agent gap before a turn, seconds
    context_limits: tuple[tuple[float, int], ...]  # (probability, window in tokens)
    compaction_summary: Dist       # tokens after the system prompt once compacted
    p_subagents: float             # fraction of sessions with at least one group
    groups: Dist                   # groups per session, in sessions that have any
    group_size: tuple[tuple[int, float], ...]  # (subagents, weight)
    subagent_requests: Dist        # requests per subagent
    subagent_system: Dist          # tokens of a subagent type's shared system prompt
    subagent_task: Dist            # tokens of a subagent's own task prompt
    subagent_growth: Dist
    subagent_out: Dist
    subagent_think: Dist
    subagent_types: tuple[str, ...]
    stagger: Dist                  # seconds between subagent starts within a group
    p_joined: float
    max_concurrent: int = 3        # a group that would exceed it is not started
    api_base: float = 1.0
    prefill_tps: float = 8000.0
    decode_tps: float = 60.0
    # target figures: stats key path ("a.b") -> (value, short source note)
    targets: dict = field(default_factory=dict)


AGENTX = SynthProfile(
    name="agentx",
    description="AgentX v1.0 published figures (shared/AGENTX.md)",
    block_size=64,
    model="agentx-main",
    subagent_model="agentx-subagent",
    turns=D((0, 2), (0.1, 7), (0.5, 43), (0.75, 150), (0.9, 400), (0.99, 1100), (1, 1600)),
    first_context=D((0, 12000), (0.5, 20000), (0.9, 30000), (1, 60000)),
    system_tokens=D((0, 9000), (0.5, 15000), (1, 20000)),
    growth=D((0, 40), (0.1, 250), (0.5, 1650), (0.9, 4500), (0.99, 52000), (1, 200000)),
    out_tokens=D((0, 1), (0.1, 90), (0.5, 600), (0.9, 2600), (0.99, 9000), (1, 32000)),
    think_time=D((0, 0.3), (0.5, 4.7), (0.9, 95.0), (0.99, 3100.0), (1, 36000.0)),
    context_limits=((0.15, 180_000), (0.85, 900_000)),
    compaction_summary=D((0, 6000), (0.5, 15000), (1, 40000)),
    p_subagents=0.445,
    groups=D((0, 1), (0.25, 2), (0.5, 5.5), (0.9, 25), (1, 50)),
    group_size=((1, 0.35), (2, 0.3), (3, 0.35)),
    subagent_requests=D((0, 2), (0.5, 7), (0.9, 20), (1, 40)),
    subagent_system=D((0, 8000), (0.5, 11000), (1, 16000)),
    subagent_task=D((0, 100), (0.5, 300), (1, 2000)),
    subagent_growth=D((0, 50), (0.1, 300), (0.5, 1800), (0.9, 7000), (0.99, 30000), (1, 60000)),
    subagent_out=D((0, 10), (0.1, 80), (0.5, 300), (0.9, 900), (0.99, 3500), (1, 8000)),
    subagent_think=D((0, 1), (0.5, 4), (0.9, 12), (0.99, 40), (1, 60)),
    subagent_types=("Explore", "general-purpose", "Plan"),
    stagger=D((0, 0.5), (0.5, 6), (0.9, 40), (1, 120)),
    p_joined=0.7,
    targets={
        "turns_per_session.p50": (43, "median 43 turns per session"),
        "in_tokens.p50": (142016, "median request 142,016 input tokens"),
        "in_tokens_main.p50": (254000, "main-agent inputs median 254K"),
        "in_tokens_main.p90": (651000, "main-agent inputs p90 651K"),
        "out_tokens.p50": (444, "median request 444 output tokens"),
        "out_tokens_main.p50": (600, "outputs median about 600"),
        "new_prefill.p50": (1700, "new prefill median about 1.7K"),
        "new_prefill.mean": (3800, "new prefill mean 3.8K"),
        "new_prefill.p99": (47000, "new prefill p99 47K"),
        "think_time.p50": (5.0, "gaps median about 5 s"),
        "think_time.p90": (130.0, "gaps p90 about 130 s"),
        "think_time.p99": (3240.0, "gaps p99 about 54 min"),
        "subagents.fraction_sessions_with_groups": (0.445, "44.5% of sessions"),
        "subagents.groups_per_session.p50": (4, "median 4 groups"),
        "subagents.requests_per_group.p50": (16, "16 requests per group"),
        "subagents.max_concurrent_subagents": (3, "up to about 3 at once"),
        "theoretical_hit_rate": (0.983, "98.3% ideal-cache hit rate"),
        "requests_per_session": (251, "393 sessions, 98.8K requests"),
    },
)

# Statistics of the 36 shipped Weka traces (shared/traces/weka, `loomserve bench stats`).
WEKA_SMALL = SynthProfile(
    name="weka-small",
    description="the shipped Weka traces (36 sessions, shared/traces/weka)",
    block_size=64,
    model="weka-main",
    subagent_model="weka-subagent",
    turns=D((0, 3), (0.1, 4), (0.5, 35), (0.9, 125), (0.99, 167), (1, 182)),
    first_context=D((0, 9900), (0.1, 16000), (0.5, 21000), (0.85, 30000), (0.9, 190000), (1, 260000)),
    system_tokens=D((0, 8000), (0.5, 14000), (1, 17000)),
    growth=D((0, 20), (0.1, 200), (0.5, 650), (0.9, 3400), (0.99, 17500), (1, 100000)),
    out_tokens=D((0, 1), (0.1, 110), (0.5, 226), (0.9, 937), (0.99, 4080), (1, 12000)),
    think_time=D((0, 0.5), (0.5, 10.0), (0.9, 129.0), (0.99, 2950.0), (1, 20000.0)),
    context_limits=((1.0, 330_000),),
    compaction_summary=D((0, 15000), (0.5, 40000), (1, 90000)),
    p_subagents=0.167,
    groups=D((0, 1), (0.5, 1.5), (1, 2.49)),
    group_size=((1, 0.4), (2, 0.2), (3, 0.4)),
    subagent_requests=D((0, 5), (0.5, 11), (0.9, 24), (1, 24.49)),
    subagent_system=D((0, 9500), (0.5, 11500), (1, 18000)),
    subagent_task=D((0, 100), (0.5, 200), (1, 400)),
    subagent_growth=D((0, 100), (0.1, 370), (0.5, 1840), (0.9, 12700), (0.99, 59000), (1, 120000)),
    subagent_out=D((0, 10), (0.1, 120), (0.5, 226), (0.9, 580), (0.99, 3800), (1, 4000)),
    subagent_think=D((0, 1), (0.5, 4), (0.9, 14), (0.99, 40), (1, 49)),
    subagent_types=("Explore",),
    stagger=D((0, 5), (0.5, 40), (1, 130)),
    p_joined=0.0,
    api_base=1.0, prefill_tps=10000.0, decode_tps=39.0,
    targets={
        "turns_per_session.p50": (35, "weka p50"),
        "in_tokens.p50": (94400, "weka p50"),
        "out_tokens.p50": (226, "weka p50"),
        "new_prefill.p50": (745, "weka p50"),
        "new_prefill.mean": (4038, "weka mean"),
        "think_time.p50": (10.0, "weka p50"),
        "think_time.p90": (129.0, "weka p90"),
        "subagents.fraction_sessions_with_groups": (0.167, "weka 6 of 36"),
        "subagents.requests_per_group.p50": (13, "weka p50"),
        "theoretical_hit_rate": (0.958, "weka"),
    },
)

# Short contexts for CPU-only machines: the AgentX shape scaled down about 30x in tokens and
# 5x in turns, short gaps.
CPU = SynthProfile(
    name="cpu",
    description="AgentX shape with short contexts and gaps, for CPU-only replays",
    block_size=64,
    model="cpu-main",
    subagent_model="cpu-subagent",
    turns=D((0, 2), (0.1, 3), (0.5, 9), (0.9, 25), (1, 60)),
    first_context=D((0, 700), (0.5, 1000), (1, 2000)),
    system_tokens=D((0, 400), (0.5, 600), (1, 700)),
    growth=D((0, 10), (0.1, 30), (0.5, 120), (0.9, 400), (0.99, 1500), (1, 3000)),
    out_tokens=D((0, 1), (0.1, 8), (0.5, 40), (0.9, 150), (1, 400)),
    think_time=D((0, 0.1), (0.5, 1.0), (0.9, 8.0), (0.99, 30.0), (1, 60.0)),
    context_limits=((1.0, 8_000),),
    compaction_summary=D((0, 300), (0.5, 600), (1, 1200)),
    p_subagents=0.445,
    groups=D((0, 1), (0.5, 2), (1, 4)),
    group_size=((1, 0.35), (2, 0.3), (3, 0.35)),
    subagent_requests=D((0, 2), (0.5, 4), (1, 10)),
    subagent_system=D((0, 300), (0.5, 400), (1, 600)),
    subagent_task=D((0, 20), (0.5, 60), (1, 200)),
    subagent_growth=D((0, 10), (0.5, 120), (1, 1500)),
    subagent_out=D((0, 1), (0.5, 30), (1, 200)),
    subagent_think=D((0, 0.1), (0.5, 0.5), (1, 3)),
    subagent_types=("Explore", "general-purpose"),
    stagger=D((0, 0.1), (0.5, 1), (1, 5)),
    p_joined=0.7,
    api_base=0.2, prefill_tps=2000.0, decode_tps=20.0,
    targets={
        "turns_per_session.p50": (9, "profile"),
        "new_prefill.p50": (120, "profile"),
        "think_time.p50": (1.0, "profile"),
        "subagents.fraction_sessions_with_groups": (0.445, "profile"),
    },
)

PROFILES = {p.name: p for p in (AGENTX, WEKA_SMALL, CPU)}


# ---------------------------------------------------------------------------------------------
# generation

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


def _get(st: dict, key: str):
    if key == "requests_per_session":
        return st["requests"]["total"] / st["sessions"] if st["sessions"] else None
    v = st
    for part in key.split("."):
        v = v[part]
    return v


def compare(prof: SynthProfile, st: dict) -> list[dict]:
    """Rows {key, target, measured, ratio, source} for the profile's targets."""
    rows = []
    for key, (target, note) in prof.targets.items():
        m = _get(st, key)
        rows.append({"key": key, "target": target, "measured": m,
                     "ratio": (m / target) if (m is not None and target) else None,
                     "source": note})
    return rows


def format_compare(rows: list[dict]) -> str:
    def f(v):
        if v is None:
            return "-"
        if isinstance(v, float) and abs(v) < 10:
            return f"{v:.3f}"
        return f"{v:,.0f}"
    lines = [f"{'statistic':42}{'target':>12}{'measured':>12}{'ratio':>8}"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"{r['key']:42}{f(r['target']):>12}{f(r['measured']):>12}{ratio:>8}"
                     f"  {r['source']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI

def add_arguments(p) -> None:
    p.add_argument("--profile", default="agentx", choices=sorted(PROFILES),
                   help="target profile (default agentx: the AgentX v1.0 published figures)")
    p.add_argument("--sessions", type=int, default=64, help="number of sessions (default 64)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--out", required=True, help="output directory (trace_NNNN.json)")
    p.add_argument("--forked-subagents", type=float, default=0.0, metavar="FRACTION",
                   help="fraction of subagents forked from the parent's context (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def main(args) -> int:
    prof = PROFILES[args.profile]
    if args.sessions < 1:
        print("error: --sessions must be >= 1", file=sys.stderr)
        return 2
    if not 0.0 <= args.forked_subagents <= 1.0:
        print("error: --forked-subagents must lie in [0, 1]", file=sys.stderr)
        return 2

    def progress(i, n):
        if i == n or i % max(1, n // 20) == 0:
            print(f"\rsynth: {i}/{n} sessions", end="\n" if i == n else "", file=sys.stderr)

    st = write_traces(prof, args.sessions, args.seed, args.out, args.forked_subagents, progress)
    rows = compare(prof, st)
    if args.json:
        stats = {k: v for k, v in st.items() if k != "per_trace"}
        print(json.dumps({"profile": prof.name, "sessions": args.sessions, "seed": args.seed,
                          "out": args.out, "forked_subagents": args.forked_subagents,
                          "compare": rows, "stats": stats}))
    else:
        from loomserve.bench.stats import format_stats
        print(f"wrote {args.sessions} sessions to {args.out} (profile {prof.name}: "
              f"{prof.description})", file=sys.stderr)
        print(format_stats(st))
        print()
        print(format_compare(rows))
    return 0
