"""The pd-profile result: one dict (what --json prints), its markdown table and its plot.

`summarize` turns the measured levels into the result: both saturations, the P:D ratio, the
smallest integer form of it and the --role layout for N instances (model.py has the formula).
"""

from __future__ import annotations

from loomserve.bench.pd_profile.model import layout, pd_ratio, saturation, simple_ratio
from loomserve.bench.pd_profile.runner import Level, Workload

__all__ = ["summarize", "markdown", "plot"]


def summarize(workload: Workload, prefill: list[Level], decode: list[Level],
              combined: list[Level], instances: int, gain: float = 0.05,
              colocated: bool = False) -> dict:
    """The whole result. Raises ValueError when a phase has no level with throughput."""
    p_sat = saturation([(lv.concurrency, lv.prefill_tps) for lv in prefill], gain)
    d_sat = saturation([(lv.concurrency, lv.decode_tps) for lv in decode], gain)
    r = pd_ratio(workload.prefill_len, workload.output_len, p_sat.rate, d_sat.rate)
    p, d = simple_ratio(r)
    roles = layout(r, instances)
    notes = []
    for name, s in (("prefill", p_sat), ("decode", d_sat)):
        if not s.reached:
            notes.append(f"{name} did not saturate by the highest concurrency: its rate is a "
                         "lower bound (raise --max-concurrency)")
    if colocated:
        notes.append("prefill and decode were profiled on the same instance (co-located)")
    return {
        "workload": {"input_len": workload.input_len, "output_len": workload.output_len,
                     "prefill_len": workload.prefill_len},
        "prefill": {"saturation": vars(p_sat), "levels": [lv.to_dict() for lv in prefill]},
        "decode": {"saturation": vars(d_sat), "levels": [lv.to_dict() for lv in decode]},
        "combined": {"levels": [lv.to_dict() for lv in combined]},
        "ratio": {"prefill_per_decode": r, "simple": [p, d]},
        "layout": {"instances": instances, "roles": roles,
                   "flags": [f"--role {role}" for role in roles]},
        "notes": notes,
    }


def _fmt(x, nd: int = 1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def markdown(result: dict) -> str:
    """The table of every level, then the ratio and the recommended layout."""
    w = result["workload"]
    lines = [f"Workload: {w['input_len']} input tokens ({w['prefill_len']} uncached), "
             f"{w['output_len']} output tokens.", "",
             "| phase | concurrency | requests | errors | prefill tok/s | decode tok/s | req/s "
             "| TTFT p50 ms | TTFT p90 ms | ITL p50 ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for phase in ("prefill", "decode", "combined"):
        for lv in result[phase]["levels"]:
            lines.append(
                f"| {phase} | {lv['concurrency']} | {lv['requests']} | {lv['errors']} "
                f"| {_fmt(lv['prefill_tps'])} | {_fmt(lv['decode_tps'])} | {_fmt(lv['rps'], 2)} "
                f"| {_fmt(lv['ttft_ms'].get('p50'))} | {_fmt(lv['ttft_ms'].get('p90'))} "
                f"| {_fmt(lv['itl_ms'].get('p50'))} |")
    ps, ds = result["prefill"]["saturation"], result["decode"]["saturation"]
    r = result["ratio"]
    p, d = r["simple"]
    lay = result["layout"]
    lines += ["",
              f"Prefill saturation: {_fmt(ps['rate'])} prompt tok/s at concurrency "
              f"{ps['concurrency']}{'' if ps['reached'] else ' (not saturated)'}; decode "
              f"saturation: {_fmt(ds['rate'])} generated tok/s at concurrency "
              f"{ds['concurrency']}{'' if ds['reached'] else ' (not saturated)'}.",
              f"P:D = ({w['prefill_len']} / {_fmt(ps['rate'])}) / ({w['output_len']} / "
              f"{_fmt(ds['rate'])}) = {r['prefill_per_decode']:.2f} prefill per decode "
              f"instance, about {p} prefill : {d} decode.",
              f"Layout for {lay['instances']} instances: "
              + ", ".join(f"{lay['roles'].count(x)} x --role {x}"
                          for x in ("prefill", "decode", "both") if x in lay["roles"]) + "."]
    lines += [f"Note: {n}." for n in result["notes"]]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Left: phase-1 throughput against concurrency; right: the combined sweep's output
    throughput and TTFT p50. Needs matplotlib (headless Agg backend)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    lines = []
    for phase, key, style, color in (("prefill", "prefill_tps", "o-", "tab:blue"),
                                     ("decode", "decode_tps", "s--", "tab:orange")):
        lv = result[phase]["levels"]
        ax = a1 if phase == "prefill" else a1.twinx()  # own axis: the scales differ a lot
        lines += ax.plot([x["concurrency"] for x in lv], [x[key] for x in lv], style,
                         color=color, label=f"{phase}-only ({phase} tok/s)")
        ax.set_ylabel(f"{phase} tok/s", color=color)
    a1.legend(handles=lines, loc="best", fontsize=8)
    _ticks(a1, [x["concurrency"] for x in result["prefill"]["levels"] + result["decode"]["levels"]])
    a1.set_xlabel("concurrency")
    a1.set_title(f"Phase 1: saturation (P:D = {result['ratio']['prefill_per_decode']:.2f})")
    comb = result["combined"]["levels"]
    if comb:
        cs = [x["concurrency"] for x in comb]
        a2.plot(cs, [x["decode_tps"] for x in comb], "o-", color="tab:green")
        a2.set_ylabel("output tok/s", color="tab:green")
        t = a2.twinx()
        t.plot(cs, [x["ttft_ms"].get("p50") or 0 for x in comb], "s--", color="tab:red")
        t.set_ylabel("TTFT p50 ms", color="tab:red")
        _ticks(a2, cs)
    a2.set_xlabel("concurrency")
    a2.set_title("Phase 2: combined deployment" if comb else "Phase 2: not run (no --router)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ticks(ax, concurrencies: list[int]) -> None:
    ax.set_xscale("log", base=2)
    cs = sorted(set(concurrencies))
    ax.set_xticks(cs, [str(c) for c in cs])
