"""OpenAI-compatible servers as systems of the decode benchmark, and their command lines.

`ServedSystem` sends C concurrent streaming /v1/completions requests (token-id prompts, greedy,
`ignore_eos`, `stream_options.include_usage`) and measures their aggregate decode rate.
`loomserve_argv` and `llama_server_argv` return argv builders that take the port.

Invariant: a round in which a stream stops short of max_tokens is reported with an error, so
a figure never silently counts fewer tokens than asked for.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, Sequence

from common import (
    DecodeMeasurement,
    decode_rate,
    llama_repack_args,
    run_concurrent_streams,
    which_loomserve,
)

__all__ = ["completion_body", "served_model_id", "ServedSystem", "loomserve_argv",
           "llama_server_argv"]


def completion_body(prompt: list[int], max_tokens: int, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
        # llama-server reads these native fields from the OAI endpoint too; others ignore them
        "n_predict": max_tokens, "cache_prompt": False,
    }
    if model:
        body["model"] = model
    return body


def served_model_id(base_url: str) -> str | None:
    import httpx

    try:
        data = httpx.get(base_url + "/v1/models", timeout=10).json()
        return data["data"][0]["id"]
    except Exception:  # noqa: BLE001 - the model field is optional for both servers
        return None


class ServedSystem:
    """An OpenAI-compatible server as a system of the interleaved loop (see HFGenerate)."""

    def __init__(self, name: str, base_url: str) -> None:
        self.name, self.base_url = name, base_url
        self.model = served_model_id(base_url)

    def _run(self, prompts: list[list[int]], n: int):
        return asyncio.run(run_concurrent_streams(
            self.base_url, [completion_body(p, n, self.model) for p in prompts]))

    def warm_up(self, prompts: list[list[int]]) -> None:
        self._run(prompts, 8)

    def measure(self, prompts: list[list[int]], max_tokens: int, label: str) -> DecodeMeasurement:
        results = self._run(prompts, max_tokens)
        m = decode_rate(results)
        short = [x.n_tokens for x in results if x.error is None and x.n_tokens != max_tokens]
        if short:
            m.errors.append(f"{len(short)} streams did not produce max_tokens: {short[:4]}")
        print(f"[{self.name}] {label}: {m.tok_per_s:8.1f} tok/s ({m.decode_tokens} tokens in "
              f"{m.window_s:.2f}s{'; ERRORS: ' + '; '.join(m.errors[:3]) if m.errors else ''})",
              file=sys.stderr, flush=True)
        return m


def loomserve_argv(model: str, dtype: str | None, max_num_seqs: int, extra: Sequence[str]):
    """dtype None: loomserve's default (no --dtype)."""
    def argv(port: int) -> list[str]:
        return [*which_loomserve(), "serve", model, "--host", "127.0.0.1",
                "--port", str(port), *(["--dtype", dtype] if dtype else []),
                "--max-num-seqs", str(max_num_seqs), *extra]
    return argv


def llama_server_argv(binary: str, model: str, slots: int, ctx_per_slot: int, threads: int,
                      extra: Sequence[str], repack: bool | None = None):
    """llama-server argv. ``-c`` is the total context, split evenly over the ``-np`` slots
    (the KV cache is not unified when -np is given). ``repack`` None: llama.cpp's default
    (repacked weight layouts on) unless the CPU reports AMX, whose buffer type crashed with a
    fault in ldtilecfg on an Intel VM here (common.llama_repack_args); True/False force it.
    On the AMD EPYC (Zen 4) VM the repack lifted llama-server's Q4_1 decode ~20%."""
    def argv(port: int) -> list[str]:
        return [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port),
                "-np", str(slots), "-c", str(slots * ctx_per_slot), "--cont-batching",
                "-t", str(threads), "-tb", str(threads), "--no-webui",
                "-cram", "0",  # no host-RAM prompt cache: saves memory, can't help fresh prompts
                *llama_repack_args(repack), *extra]
    return argv
