#!/usr/bin/env bash
# Build llama.cpp's `llama-server` and `llama-quantize` into benchmarks/.peers/bin from the same
# sources (the llama-cpp-python sdist's vendored llama.cpp) and build dir as
# build_llama_server.sh: benchmarks/gguf_agreement.py quantizes its fixtures with the one and
# compares against the other. Idempotent (--force rebuilds); env as build_llama_server.sh.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LLAMA_TARGETS="${LLAMA_TARGETS:-llama-server llama-quantize}" exec bash "$HERE/build_llama_server.sh" "$@"
