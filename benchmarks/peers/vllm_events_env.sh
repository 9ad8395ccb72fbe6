#!/usr/bin/env bash
# Build benchmarks/.peers/vllm-events-venv: vLLM 0.33.0's Python sources with only what
# `import vllm.distributed.kv_events` needs, so tests/control/test_kv_events_vllm.py can decode
# loomserve's KV event bytes with vLLM's own classes. vLLM is never a loomserve dependency.
#
# Like vllm_env.sh, the peer venv borrows loomserve's venv (torch, transformers, pydantic, ...)
# through a .pth written last, so pip only ever sees and writes the peer venv. The package list
# below was found by trial import against a clean `make install` of loomserve (openai-harmony and
# llguidance are not loomserve dependencies: vllm.reasoning imports them); VLLM_EVENTS_EXTRA_PKGS overrides it.
# Re-runs are cheap (pip skips what the peer has); the venv is ready once its marker exists.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"          # benchmarks/
root="$(cd "$here/.." && pwd)"
venv="${VLLM_EVENTS_VENV:-$here/.peers/vllm-events-venv}"
base_py="${BASE_PYTHON:-$root/.venv/bin/python}"
rm -f "$venv/.ready"
if [ ! -x "$venv/bin/python" ]; then
  mkdir -p "$(dirname "$venv")"
  "$base_py" -m venv "$venv"
fi
base_site="$("$base_py" -c 'import site; print(site.getsitepackages()[0])')"
peer_site="$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
if [ "$base_site" = "$peer_site" ]; then
  echo "vllm_events_env.sh: the peer venv resolves to loomserve's own site-packages" >&2
  exit 1
fi
rm -f "$peer_site/_loomserve_base.pth"
# The wheel's Python sources only: its compiled kernels (~800 MB of the 877 MB installed) are
# never loaded by the event classes, and skipping them halves the build time.
if [ ! -f "$peer_site/vllm/distributed/kv_events.py" ]; then
  wheels="$(mktemp -d)"
  trap 'rm -rf "$wheels"' EXIT
  "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps "vllm==0.33.0" \
    -d "$wheels"
  "$venv/bin/python" - "$wheels" "$peer_site" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(f"{sys.argv[1]}/vllm-0.33.0-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if not n.endswith(".so")])
PY
fi
# shellcheck disable=SC2086
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
  ${VLLM_EVENTS_EXTRA_PKGS:-msgspec pyzmq psutil cbor2 pybase64 cachetools cloudpickle uvloop \
  py-cpuinfo partial-json-parser openai-harmony llguidance}
echo "$base_site" > "$peer_site/_loomserve_base.pth"
"$venv/bin/python" -c 'import vllm.distributed.kv_events; print("vllm.distributed.kv_events importable")'
touch "$venv/.ready"
