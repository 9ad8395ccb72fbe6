"""A markdown table of benchmarks/results/long_context.json (for BENCHMARKS.md)."""

from __future__ import annotations

from typing import Any

__all__ = ["markdown"]


def _cell(fig: dict[str, Any] | None, key: str, unit: str) -> str:
    if not fig:
        return "-"
    s = f"{fig[key]:,.2f} {unit}".strip()
    if "speedup_vs_llama_server" in fig:
        s += f" ({fig['speedup_vs_llama_server']:.2f}x llama)"
    return s


def markdown(payload: dict[str, Any]) -> str:
    lim, summ = payload["limits"], payload.get("summary", {})
    phases = sorted({p for row in summ.values() for p in row},
                    key=lambda p: (p[0] != "d", len(p), p))
    head = ["system"] + phases
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in summ.items():
        cells = [name]
        for p in phases:
            fig = row.get(p)
            if p.startswith("decode@"):
                cells.append(_cell(fig, "ms_per_token", "ms/tok")
                             + (f", {fig['x_kv_limit']:.1f}x KV limit" if fig else ""))
            elif p == "prefill24k":
                cells.append(_cell(fig, "s", "s") + (f", {fig['x_flop_limit']:.1f}x FLOP limit"
                                                     if fig else ""))
            else:
                cells.append(_cell(fig, "tok_per_s", "tok/s"))
        lines.append("| " + " | ".join(cells) + " |")
    kv = ", ".join(f"{int(c) // 1024}K: {d['kv_limit_ms']:.2f} ms "
                   f"({d['kv_plus_weights_limit_ms']:.2f} with weights)"
                   for c, d in lim["decode"].items())
    lines += ["", f"Limits: read bandwidth {lim['read_gbs']} GB/s (membw.run_all, 2 threads); "
                  f"KV read per decode token at {kv}; 24K-over-104K prefill "
                  f"{lim['prefill24k']['total_flops'] / 1e12:.2f} TFLOP at "
                  f"{lim['fp32_matmul_gflops']} GFLOP/s fp32 torch.mm = "
                  f"{lim['prefill24k']['flop_limit_s']} s."]
    return "\n".join(lines)
