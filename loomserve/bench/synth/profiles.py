"""The synthesizer's target profiles: the distributions a synthetic session is drawn from.

`Dist` is a distribution given by quantiles; `SynthProfile` holds one per quantity of the
session model (turns, first context, growth per turn, outputs, think times, context windows,
subagent groups...) plus the target figures the generated traces are checked against.

    agentx       AgentX v1.0 published figures (shared/AGENTX.md)
    weka-small   the 36 shipped Weka traces (shared/traces/weka)
    cpu          the AgentX shape with short contexts and gaps, for CPU-only replays

Invariants: a quantile table starts at probability 0, ends at 1, and both its probabilities and
its values are sorted; sampling reproduces every listed quantile in a large sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Dist", "D", "SynthProfile", "AGENTX", "WEKA_SMALL", "CPU", "PROFILES"]


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
