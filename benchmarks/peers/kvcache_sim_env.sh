#!/usr/bin/env bash
# Build benchmarks/.peers/kvcache-sim-venv (gitignored) with KVCache.AI's `kvcache-simulator`
# (PyPI, Apache-2.0), the reference that benchmarks/simulator_check.py compares
# `loomserve bench simulate` against. It is a benchmarking peer only, never a loomserve
# dependency. The package is pure Python; its default backend compiles a bundled C++ replay
# core on first use (needs `c++`), and its Python backend needs nothing else.
#
# Usage:  benchmarks/peers/kvcache_sim_env.sh
# Env:    KVCACHE_SIM_SPEC (default kvcache-simulator==0.1.3, the version the check was
#         written against), BASE_PYTHON (default: loomserve's .venv python, else python3).
# Idempotent: reinstalls nothing when the pinned version is already there.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"          # benchmarks/
root="$(cd "$here/.." && pwd)"
venv="$here/.peers/kvcache-sim-venv"
spec="${KVCACHE_SIM_SPEC:-kvcache-simulator==0.1.3}"
if [ -n "${BASE_PYTHON:-}" ]; then base_py="$BASE_PYTHON"
elif [ -x "$root/.venv/bin/python" ]; then base_py="$root/.venv/bin/python"
else base_py=python3; fi
if [ ! -x "$venv/bin/python" ]; then
  mkdir -p "$here/.peers"
  "$base_py" -m venv "$venv"
fi
"$venv/bin/pip" install -q "$spec"
"$venv/bin/python" - <<'PY'
from importlib.metadata import version
import kvcache_sim.policies, kvcache_sim.cpp_backend  # noqa: F401  (the APIs the check uses)
print("kvcache-simulator", version("kvcache-simulator"), "importable")
PY
