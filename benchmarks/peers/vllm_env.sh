#!/usr/bin/env bash
# Build benchmarks/.peers/vllm-venv: vLLM 0.33.0 installed with --no-deps, used only to drive its
# v1 KVCacheManager from benchmarks/kv_manager_cost.py. The venv sees loomserve's venv packages
# (torch CPU, numpy, pydantic, msgspec, ...) through a .pth file instead of reinstalling them;
# the few extra pure-Python modules vllm.v1.core imports are installed into the peer venv only.
# vLLM is never a loomserve dependency.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"          # benchmarks/
root="$(cd "$here/.." && pwd)"
venv="$here/.peers/vllm-venv"
base_py="${BASE_PYTHON:-$root/.venv/bin/python}"
if [ ! -x "$venv/bin/python" ]; then
  mkdir -p "$here/.peers"
  "$base_py" -m venv "$venv"
fi
base_site="$("$base_py" -c 'import site; print(site.getsitepackages()[0])')"
peer_site="$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
echo "$base_site" > "$peer_site/_loomserve_base.pth"
"$venv/bin/pip" install -q --no-deps "vllm==0.33.0"
# Pure-Python imports of vllm.v1.core.* not already in loomserve's venv (found by trial import).
"$venv/bin/pip" install -q --no-deps ${VLLM_EXTRA_PKGS:-\
  cbor2 cloudpickle psutil cachetools blake3 pyzmq py-cpuinfo pybase64 pillow uvloop \
  aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl \
  openai-harmony partial-json-parser llguidance xgrammar apache-tvm-ffi}
"$venv/bin/python" -c "from vllm.v1.core.kv_cache_manager import KVCacheManager; from vllm.v1.request import Request; print('vllm KVCacheManager importable')"
