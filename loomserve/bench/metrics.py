"""Per-request records of a replay and the AgentX metrics computed from them.

Definitions (only successful, non-primer requests count; times in seconds):
- TTFT = first token chunk - send; E2E = end - send; ITL = gaps between consecutive token
  chunks; TPOT_i = (last chunk - first chunk) / (output_tokens_i - 1).
- E2E-normalized interactivity = 1 / P90(e2e_i / output_tokens_i)  (tokens/s per user).
- ITL-based p90 interactivity = 1 / P90(TPOT_i).
- Window = first measured send .. last measured end. TPGS = (prompt tokens, cached included,
  + output tokens) / window / devices; output tokens/s likewise.
- Served prefix-hit rate = sum cached_tokens / sum prompt_tokens (server usage); theoretical =
  sum theoretical_cached / sum intended prompt tokens, from an infinite cache over the prompts
  actually sent, per session replay, in send order (computed at send time by the replay).
- Served hit rate by source (loomserve servers only): the server's counter
  loomserve_prefix_cache_hit_tokens_by_source_total{source=device|host|disk|mooncake|redis...}
  scraped from /metrics before and after the replay; its delta is the hit tokens per source over
  every request the replay sent (primers included). Attributed to the measured requests pro
  rata (x measured cached / delta total, exactly 1 when primers hit nothing and nobody else
  used the server), so the per-source tokens sum to the served cached tokens and the shares
  (tokens / measured prompt tokens) sum to the served hit rate. The raw delta is kept beside.
- Cost: served dollars = window hours x devices x price per device-hour; API-equivalent dollars
  of the same tokens at a price list (cached input, uncached input, output per million).
Percentiles use linear interpolation (numpy's default).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import numpy as np

from loomserve.bench.miss_gap import attribute_gap

DEFAULT_PRICES = {"cached_input": 0.50, "uncached_input": 5.0, "output": 25.0}  # $ per M tokens


@dataclass
class RequestRecord:
    send_time: float
    end_time: float | None = None
    first_token_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # token chunks, absolute (run clock)
    prompt_tokens: int | None = None     # server usage
    cached_tokens: int | None = None     # server usage prompt_tokens_details.cached_tokens
    output_tokens: int | None = None     # server usage completion_tokens (else chunks counted)
    intended_prompt_tokens: int = 0      # what the replay sent (ids) / meant to send (text)
    theoretical_cached_tokens: int = 0   # infinite-cache hit over this session replay
    max_tokens: int = 0
    truncated: bool = False
    primer: bool = False
    error: str | None = None             # http_<status> | timeout | connection | protocol | cancelled
    error_detail: str | None = None
    slot: int = 0
    session: str = ""                    # session replay id (X-Session-ID of the main agent)
    trace: str = ""
    agent: str = "main"
    turn: int = 0
    prompt_ids: list[int] | None = None  # only with --record-prompts
    output_text: str | None = None       # only with --record-outputs
    # server usage prompt_tokens_details.miss_causes (loomserve servers): uncached tokens by
    # cause (loomserve.kv.miss_causes)
    miss_causes: dict[str, int] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_time is not None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RequestRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def pct(values, qs=(50, 90, 99)) -> dict:
    """p50/p90/p99/mean/count of a sample (None entries when empty)."""
    a = np.asarray(list(values), dtype=float)
    out = {"count": int(a.size)}
    if a.size == 0:
        out.update({f"p{q}": None for q in qs})
        out["mean"] = None
        return out
    for q in qs:
        out[f"p{q}"] = float(np.percentile(a, q))
    out["mean"] = float(a.mean())
    return out


def _inv(x):
    return None if x is None or x <= 0 else 1.0 / x


def measured(records) -> list[RequestRecord]:
    return [r for r in records if not r.primer and r.ok]


def compute_metrics(records, devices: int = 1, device_price_per_hour: float | None = None,
                    prices: dict | None = None, timeline_bins: int = 60,
                    hit_tokens_by_source: dict[str, float] | None = None) -> dict:
    """hit_tokens_by_source: the server's hit-token counter delta per source over the replay
    (see the module docstring), or None when the server does not export it."""
    prices = {**DEFAULT_PRICES, **(prices or {})}
    recs = list(records)
    ok = measured(recs)
    ttft = [r.first_token_time - r.send_time for r in ok if r.first_token_time is not None]
    e2e = [r.end_time - r.send_time for r in ok]
    itl: list[float] = []
    tpot: list[float] = []
    norm: list[float] = []
    for r in ok:
        ct = r.chunk_times
        itl.extend(b - a for a, b in zip(ct, ct[1:]))
        n = r.output_tokens or 0
        if n > 1 and len(ct) >= 2:
            tpot.append((ct[-1] - ct[0]) / (n - 1))
        if n > 0:
            norm.append((r.end_time - r.send_time) / n)

    prompt = sum(_prompt(r) for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    output = sum(r.output_tokens or 0 for r in ok)
    intended = sum(r.intended_prompt_tokens for r in ok)
    theo = sum(r.theoretical_cached_tokens for r in ok)
    if ok:
        t0 = min(r.send_time for r in ok)
        t1 = max(r.end_time for r in ok)
        window = t1 - t0
    else:
        t0 = t1 = window = 0.0
    total = prompt + output
    norm_p90 = pct(norm)["p90"]
    tpot_p90 = pct(tpot)["p90"]

    errors: dict[str, int] = {}
    for r in recs:
        if r.error is not None and not r.primer:
            errors[r.error] = errors.get(r.error, 0) + 1
    primer_errors = sum(1 for r in recs if r.primer and r.error is not None)

    m = {
        "requests": {"ok": len(ok), "errors": sum(errors.values()),
                     "primers": sum(1 for r in recs if r.primer),
                     "primer_errors": primer_errors,
                     "truncated": sum(1 for r in ok if r.truncated),
                     "total": len(recs)},
        "errors_by_kind": errors,
        "window_s": window,
        "devices": devices,
        "tokens": {"prompt": prompt, "cached": cached, "uncached": prompt - cached,
                   "output": output, "total": total, "intended_prompt": intended,
                   "theoretical_cached": theo},
        "tpgs": total / window / devices if window > 0 else None,
        "output_tps": output / window if window > 0 else None,
        "output_tps_per_device": output / window / devices if window > 0 else None,
        "requests_per_s": len(ok) / window if window > 0 else None,
        "ttft_s": pct(ttft),
        "itl_s": pct(itl),
        "tpot_s": pct(tpot),
        "e2e_s": pct(e2e),
        "e2e_per_output_token_s": pct(norm),
        "interactivity": _inv(norm_p90),
        "interactivity_itl_p90": _inv(tpot_p90),
        "hit_rate": {"served": cached / prompt if prompt else None,
                     "theoretical": theo / intended if intended else None},
        "cost": cost_block(prompt, cached, output, window, devices, device_price_per_hour, prices),
        "ttft_cdf": _cdf(ttft),
        "timeline": timeline(ok, t0, t1, timeline_bins),
    }
    if any(r.miss_causes is not None for r in ok):
        m["miss_gap"] = miss_gap(ok)
    if hit_tokens_by_source is not None:
        split = hit_split(hit_tokens_by_source, recs)
        m["hit_rate"]["by_source"] = split.pop("shares")
        m["tokens"]["cached_by_source"] = split.pop("tokens")
        m["hit_source_scrape"] = split
    return m


SOURCE_ORDER = ("device", "host", "disk")


def source_key(source: str) -> tuple:
    """device, host, disk, then remote tiers by name."""
    return (SOURCE_ORDER.index(source) if source in SOURCE_ORDER else len(SOURCE_ORDER), source)


def hit_split(delta: dict[str, float], records) -> dict:
    """The server's per-source hit-token delta, attributed to the measured requests."""
    recs = list(records)
    ok = measured(recs)
    prompt = sum(_prompt(r) for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    cached_all = sum(r.cached_tokens or 0 for r in recs if r.ok)  # primers too
    delta = {k: float(v) for k, v in sorted(delta.items(), key=lambda kv: source_key(kv[0]))}
    total = sum(delta.values())
    factor = cached / total if total > 0 else 0.0
    tokens = {k: v * factor for k, v in delta.items()}
    return {
        "tokens": tokens,
        "shares": {k: v / prompt if prompt else None for k, v in tokens.items()},
        "server_delta": delta,
        "server_delta_total": total,
        "replay_cached_tokens": cached,        # measured requests (usage)
        "replay_cached_tokens_all": cached_all,  # every completed request, primers included
        "attribution_factor": factor,
        "exact": total == cached,
    }


def miss_gap(ok: list[RequestRecord]) -> dict:
    """The served-vs-theoretical hit-rate gap attributed to the servers' miss causes
    (loomserve.bench.miss_gap); the theoretical hit scaled to the served prompt's length."""
    def theo(r: RequestRecord) -> int:
        p, i = _prompt(r), r.intended_prompt_tokens
        return r.theoretical_cached_tokens if not i or p == i else \
            round(r.theoretical_cached_tokens * p / i)
    return attribute_gap((_prompt(r), r.cached_tokens or 0, theo(r), r.miss_causes)
                         for r in ok)


def _prompt(r: RequestRecord) -> int:
    return r.prompt_tokens if r.prompt_tokens is not None else r.intended_prompt_tokens


def cost_block(prompt: int, cached: int, output: int, window_s: float, devices: int,
               device_price_per_hour: float | None, prices: dict) -> dict:
    uncached = prompt - cached
    api = (cached * prices["cached_input"] + uncached * prices["uncached_input"]
           + output * prices["output"]) / 1e6
    out = {"prices_per_million": dict(prices), "api_equivalent_usd": api,
           "device_price_per_hour": device_price_per_hour, "served_usd": None,
           "tokens_per_usd": None, "api_to_served_ratio": None}
    if device_price_per_hour and window_s > 0:
        served = window_s / 3600.0 * devices * device_price_per_hour
        out["served_usd"] = served
        out["tokens_per_usd"] = (prompt + output) / served
        out["api_to_served_ratio"] = api / served if served > 0 else None
    return out


def _cdf(values, points: int = 101) -> list[list[float]]:
    """[[value, fraction], ...] at `points` evenly spaced quantiles (compact, for plots)."""
    a = np.asarray(list(values), dtype=float)
    if a.size == 0:
        return []
    qs = np.linspace(0, 100, points)
    return [[float(v), float(q / 100)] for v, q in zip(np.percentile(a, qs), qs)]


def timeline(ok, t0: float, t1: float, bins: int) -> list[dict]:
    """Hit rates and tokens per time bin (by request end time), relative to the window start."""
    if not ok or t1 <= t0 or bins < 1:
        return []
    width = (t1 - t0) / bins
    acc = [[0, 0, 0, 0, 0, 0] for _ in range(bins)]  # n, prompt, cached, intended, theo, output
    for r in ok:
        i = min(bins - 1, int((r.end_time - t0) / width))
        a = acc[i]
        a[0] += 1
        a[1] += _prompt(r)
        a[2] += r.cached_tokens or 0
        a[3] += r.intended_prompt_tokens
        a[4] += r.theoretical_cached_tokens
        a[5] += r.output_tokens or 0
    return [{"t": (i + 0.5) * width, "requests": a[0],
             "served_hit_rate": a[2] / a[1] if a[1] else None,
             "theoretical_hit_rate": a[4] / a[3] if a[3] else None,
             "tokens_per_s": (a[1] + a[5]) / width}
            for i, a in enumerate(acc)]
