"""The long-context benchmark's systems: their command lines and the phases run against each.

Systems: `loomserve` (default attention backend: in-place paged kernels where present),
`loomserve-torch` (`--attention-backend torch`: gather the pages, then SDPA) and `llama-server`
(the same weights as an f32 GGUF, f32 KV cache, 2 threads, prompt cache on; weight repacking as
its default, off only on AMX hosts: common.llama_repack_args).

Phases, each resumable on its own (a fresh server recomputes what it needs first):
  decode@N     prompt = base[:N]; the first request's TTFT is a (partly cached) prefill, then
               `repeats` more requests of the now-cached prompt time decode only
  prefill24k   base[:104K] cached first, then `repeats` prompts base[:104K] + fresh 24K suffix
               (max_tokens 1): TTFT = the 24K-token prefill over the cached 104K prefix
  c64@32K      64 distinct 32K prompts prefilled (max_tokens 1), then all 64 at once again
               (prefixes cached) with max_tokens D: aggregate decode tok/s
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from common import llama_repack_args
from longctx.measure import Timed, concurrent_decode, random_prompt, timed_request

__all__ = ["loomserve_argv", "llama_argv", "run_decode", "run_prefill24k", "run_c64"]

K = 1024
PREFIX, NEW = 104 * K, 24 * K


def loomserve_argv(python: str, folder: str, backend: str | None, kv_memory: str,
                   max_seqs: int, extra: Sequence[str] = ()):
    def argv(port: int) -> list[str]:
        return [python, "-m", "loomserve", "serve", folder, "--host", "127.0.0.1",
                "--port", str(port), "--dtype", "float32", "--max-model-len", "262144",
                "--kv-cache-memory", kv_memory, "--max-num-seqs", str(max_seqs),
                "--max-num-batched-tokens", "2048", "--long-prefill-threshold", "0",
                *(["--attention-backend", backend] if backend else []), *extra]
    return argv


def llama_argv(binary: str, gguf: str, slots: int, ctx_total: int, threads: int,
               kv_type: str = "f32"):
    def argv(port: int) -> list[str]:
        return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                "-np", str(slots), "-c", str(ctx_total), "-t", str(threads),
                "-tb", str(threads), "-ctk", kv_type, "-ctv", kv_type, *llama_repack_args(),
                *(["-fa", "on"] if kv_type.startswith("q") else []),  # a quantized V needs it
                "--no-webui", "--cache-prompt", "-cram", "0"]
    return argv


def _log(system: str, msg: str) -> None:
    print(f"[{system}] {msg}", file=sys.stderr, flush=True)


def _brief(t: Timed) -> dict[str, Any]:
    d = asdict(t)
    for k in ("t_first", "t_last"):
        d.pop(k)
    return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in d.items()}


def run_decode(system: str, url: str, vocab: int, ctx: int, max_tokens: int,
               repeats: int, decode_seconds: float) -> dict[str, Any]:
    """The first request (16 tokens) prefills and gives a rate; each repeat then decodes as many
    tokens as take about ``decode_seconds`` (8 ..= max_tokens), so a slow system costs minutes,
    not hours, and a fast one is timed over many tokens."""
    prompt = random_prompt(ctx, seed=0, vocab=vocab)  # base: every context is a prefix of it
    first = timed_request(url, prompt, min(16, max_tokens))
    _log(system, f"decode@{ctx}: first ttft {first.ttft_s}s, {first.decode_ms_per_token} ms/t "
                 f"{first.error or ''}")
    ms = first.decode_ms_per_token or 1000.0
    n = int(max(8, min(max_tokens, 1000 * decode_seconds / ms)))
    runs = []
    for r in range(repeats):
        t = timed_request(url, prompt, n)
        _log(system, f"decode@{ctx} run {r + 1}: ttft {t.ttft_s:.3f}s, {n} tokens, "
                     f"{t.decode_ms_per_token} ms/t {t.error or ''}")
        runs.append(t)
    # The first request's decode is reported but not in the median (cold: just after prefill).
    ok = [t.decode_ms_per_token for t in runs if t.error is None]
    return {"context": ctx, "max_tokens": n, "first": _brief(first),
            "runs": [_brief(t) for t in runs], "decode_ms_per_token_all": ok,
            "errors": [t.error for t in [first, *runs] if t.error]}


def run_prefill24k(system: str, url: str, vocab: int, repeats: int) -> dict[str, Any]:
    base = random_prompt(PREFIX, seed=0, vocab=vocab)
    warm = timed_request(url, base, 1)
    _log(system, f"prefix {PREFIX} cached: ttft {warm.ttft_s}s {warm.error or ''}")
    runs = []
    for r in range(repeats):
        prompt = base + random_prompt(NEW, seed=1000 + r, vocab=vocab)
        t = timed_request(url, prompt, 1)
        _log(system, f"prefill {NEW} over {PREFIX} run {r + 1}: ttft {t.ttft_s}s {t.error or ''}")
        runs.append(t)
    return {"prefix": PREFIX, "new": NEW, "prefix_warm": _brief(warm),
            "runs": [_brief(t) for t in runs],
            "ttft_s_all": [t.ttft_s for t in runs if t.error is None],
            "errors": [t.error for t in [warm, *runs] if t.error]}


def run_c64(system: str, url: str, vocab: int, ctx: int, streams: int,
            max_tokens: int) -> dict[str, Any]:
    prompts = [random_prompt(ctx, seed=5000 + i, vocab=vocab) for i in range(streams)]
    fill = asyncio.run(concurrent_decode(url, prompts, 1))
    _log(system, f"c{streams}@{ctx} prefilled: {sum(t.error is None for t in fill)} ok")
    res = asyncio.run(concurrent_decode(url, prompts, max_tokens))
    ok = [t for t in res if t.error is None]
    out: dict[str, Any] = {"context": ctx, "streams": streams, "max_tokens": max_tokens,
                           "prefill_wall_s": max((t.wall_s or 0) for t in fill),
                           "errors": sorted({t.error for t in fill + res if t.error})}
    if ok:
        t0, t1 = min(t.t_first for t in ok), max(t.t_last for t in ok)
        tokens = sum(t.completion_tokens - 1 for t in ok)
        out.update(decode_tokens=tokens, window_s=round(t1 - t0, 4),
                   tok_per_s=round(tokens / (t1 - t0), 2),
                   median_ttft_s=sorted(t.ttft_s for t in ok)[len(ok) // 2])
    _log(system, f"c{streams}@{ctx}: {out.get('tok_per_s')} tok/s {out['errors'][:2]}")
    return out
