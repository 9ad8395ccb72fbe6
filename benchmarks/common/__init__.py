"""Shared helpers for loomserve's benchmark scripts (`from common import ...` with benchmarks/
on sys.path).

    paths.py        the repository root, benchmarks/results, the peers, the default GGUF
    host.py         the machine's fingerprint stored beside every result; torch threads
    results.py      JSON results under an envelope (host, commit, date, command, run), tables
    model_facts.py  model facts from a GGUF header, the decode roofline
    servers.py      a free port, a server subprocess, llama-server, the loomserve CLI
    streaming.py    a timing client for streaming completions, decode tokens/s

Only standard library + httpx + numpy (and two torch-free loomserve modules: the replay's SSE
line splitter, the kernels' CPU flags) at import time; gguf/torch/transformers are imported
lazily by the functions that need them. Every public name is importable from here.
"""

from common.host import host_info, llama_repack_args, torch_threads
from common.model_facts import ModelFacts, gguf_model_facts, roofline
from common.paths import (
    BENCH_DIR,
    BUILD_LLAMA_SERVER,
    LLAMA_SERVER_BIN,
    PEERS_DIR,
    REPO_ROOT,
    RESULTS_DIR,
    default_gguf_path,
)
from common.results import envelope, format_table, median, result_path, write_json
from common.servers import ServerProcess, ensure_llama_server, free_port, which_loomserve
from common.streaming import (
    DecodeMeasurement,
    StreamResult,
    decode_rate,
    run_concurrent_streams,
    stream_completion,
)

__all__ = ["BENCH_DIR", "REPO_ROOT", "RESULTS_DIR", "PEERS_DIR", "LLAMA_SERVER_BIN",
           "BUILD_LLAMA_SERVER", "default_gguf_path", "host_info", "llama_repack_args",
           "torch_threads", "result_path", "write_json", "envelope",
           "median", "format_table", "ModelFacts", "gguf_model_facts", "roofline", "free_port",
           "ServerProcess", "ensure_llama_server", "which_loomserve", "StreamResult",
           "stream_completion", "run_concurrent_streams", "DecodeMeasurement", "decode_rate"]
