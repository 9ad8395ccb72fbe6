#!/usr/bin/env bash
# Build llama.cpp's `llama-server` as the peer for loomserve's benchmarks (and, with
# LLAMA_TARGETS, other llama.cpp tools from the same sources: build_llama_tools.sh).
#
# The llama.cpp sources come from the llama-cpp-python sdist (which vendors them
# under vendor/llama.cpp), fetched with pip so the usual package index settings apply.
# Everything lands in benchmarks/.peers/ (gitignored); the binary ends up at
# benchmarks/.peers/bin/llama-server. This is a benchmarking peer only, never a
# dependency of loomserve.
#
# Usage:  benchmarks/peers/build_llama_server.sh [--force]
# Env:    LLAMA_TARGETS (default "llama-server": the cmake targets built, each copied to
#         benchmarks/.peers/bin/<target>), JOBS (default 2: the build machine is shared),
#         PIP (default: pip of the active venv, else /work/main/.venv/bin/pip, else pip3),
#         LLAMA_CPP_PYTHON_SPEC (default: llama-cpp-python, i.e. the newest sdist).
# Needs:  cmake >= 3.14, a C/C++ compiler, make or ninja.
#
# Idempotent: exits at once when every target's binary already exists and runs (--force
# rebuilds).
#
# Flags that matter when serving (see `llama-server --help`): -np N slots (one per client;
# -c is the total context, split over the slots unless -kvu), -cb continuous batching (on by
# default), -t/-tb threads, --no-webui, -cram 0 (no host-RAM prompt cache), and --no-repack:
# with GGML_NATIVE on a CPU that reports AMX, ggml's AMX weight buffer crashed (fault in
# ldtilecfg) on an Intel VM; --no-repack turns the extra buffer types off. The benchmarks pass
# it on AMX hosts only (common.llama_repack_args): elsewhere the repack is llama.cpp's default.
# Took ~16 min on 2 shared cores (206 compile steps).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PEERS="$(cd "$HERE/.." && pwd)/.peers"
JOBS="${JOBS:-2}"
SPEC="${LLAMA_CPP_PYTHON_SPEC:-llama-cpp-python}"
read -r -a TARGETS <<< "${LLAMA_TARGETS:-llama-server}"

built() {  # every target's binary is there and runs (llama-server: --version; others: --help)
  local t
  for t in "${TARGETS[@]}"; do
    [[ -x "$PEERS/bin/$t" ]] || return 1
    if [[ "$t" == llama-server ]]; then "$PEERS/bin/$t" --version >/dev/null 2>&1 || return 1
    else "$PEERS/bin/$t" --help >/dev/null 2>&1 || [[ $? -eq 1 ]] || return 1; fi
  done
}
if [[ "${1:-}" != "--force" ]] && built; then
  echo "already built: ${TARGETS[*]} in $PEERS/bin"
  "$PEERS/bin/llama-server" --version 2>&1 | head -n 2 || true
  exit 0
fi

if [[ -n "${PIP:-}" ]]; then :
elif [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/pip" ]]; then PIP="$VIRTUAL_ENV/bin/pip"
elif [[ -x /work/main/.venv/bin/pip ]]; then PIP=/work/main/.venv/bin/pip
else PIP=pip3; fi

mkdir -p "$PEERS/sdist" "$PEERS/bin"
cd "$PEERS"

# 1. Fetch the sdist (skipped when one is already there).
shopt -s nullglob
find_sdist() { local f=(sdist/llama_cpp_python-*.tar.gz sdist/llama-cpp-python-*.tar.gz); SDIST="${f[0]:-}"; }
find_sdist
if [[ -z "$SDIST" ]]; then
  echo "== pip download $SPEC (sdist)"
  "$PIP" download --no-binary :all: --no-deps -d sdist "$SPEC"
  find_sdist
  [[ -n "$SDIST" ]] || { echo "pip download produced no sdist" >&2; exit 1; }
fi
echo "== sdist: $SDIST"

# 2. Unpack.
SRC_ROOT="$PEERS/src/$(basename "$SDIST" .tar.gz)"
if [[ ! -d "$SRC_ROOT" ]]; then
  mkdir -p "$PEERS/src"
  tar -xzf "$SDIST" -C "$PEERS/src"
fi
LLAMA="$SRC_ROOT/vendor/llama.cpp"
[[ -f "$LLAMA/CMakeLists.txt" ]] || { echo "no vendored llama.cpp in $SRC_ROOT" >&2; exit 1; }
echo "== llama.cpp sources: $LLAMA"

# 3. Configure: Release, CPU only, tuned for this CPU, no libcurl, only what the server needs.
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
BUILD="$PEERS/build"
cmake -S "$LLAMA" -B "$BUILD" "${GEN[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=ON \
  -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
  -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TOOLS=ON

# 4. Build the requested targets only (the server lives in tools/server in recent trees,
#    examples/server in older ones; the target is `llama-server` in both). A build dir that
#    already holds libllama/ggml makes each further tool an incremental build (llama-quantize:
#    4 steps).
time cmake --build "$BUILD" --config Release --target "${TARGETS[@]}" -j "$JOBS"

for t in "${TARGETS[@]}"; do
  cp -f "$BUILD/bin/$t" "$PEERS/bin/$t"
  echo "== built $PEERS/bin/$t"
done
[[ -x "$PEERS/bin/llama-server" ]] && { "$PEERS/bin/llama-server" --version 2>&1 | head -n 2 || true; }
