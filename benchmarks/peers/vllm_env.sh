#!/usr/bin/env bash
# Build benchmarks/.peers/vllm-venv: vLLM 0.33.0 installed with --no-deps, used only to drive its
# v1 KVCacheManager from benchmarks/kv_manager_cost.py. vLLM is never a loomserve dependency.
#
# The peer venv borrows loomserve's declared dependencies (torch CPU, numpy, pydantic, ...)
# through a .pth file instead of reinstalling them. Everything else that vllm.v1.core imports is
# installed INTO THE PEER VENV, even when loomserve's venv happens to hold a copy (msgspec and pyzmq are there on some machines but are not loomserve dependencies, so a
# fresh clone lacks them: `No module named 'msgspec'`). Nothing is ever installed into
# loomserve's venv. The list was found by trial import against a base holding only
# loomserve[test,tiers]; VLLM_EXTRA_PKGS overrides it.
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
if [ "$base_site" = "$peer_site" ]; then
  echo "vllm_env.sh: the peer venv resolves to loomserve's own site-packages; refusing" >&2
  exit 1
fi
# pip runs while the .pth is absent, so it sees (and writes) the peer venv only: a copy of a
# package in loomserve's venv never counts as installed here, and re-runs skip what the peer has.
rm -f "$peer_site/_loomserve_base.pth"
pip_peer=("$venv/bin/python" -m pip install -q --no-deps)
"${pip_peer[@]}" "vllm==0.33.0"
# Imports of vllm.v1.core.* (and vllm.v1.request) that loomserve's dependencies do not provide.
# shellcheck disable=SC2086
"${pip_peer[@]}" ${VLLM_EXTRA_PKGS:-\
  msgspec pyzmq cbor2 cloudpickle psutil cachetools blake3 py-cpuinfo pybase64 pillow uvloop \
  aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl \
  openai-harmony partial-json-parser llguidance xgrammar apache-tvm-ffi}
echo "$base_site" > "$peer_site/_loomserve_base.pth"
"$venv/bin/python" - <<'EOF'
import msgspec  # noqa: F401  (a missing module names itself here rather than deep in vllm)
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: F401
from vllm.v1.request import Request  # noqa: F401
print("vllm KVCacheManager importable")
EOF
