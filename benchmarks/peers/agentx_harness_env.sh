#!/usr/bin/env bash
# Build benchmarks/.peers/agentx-venv (gitignored) with SemiAnalysis' `agentx-harness` (PyPI,
# Apache-2.0, built on NVIDIA AIPerf): the reference AgentX harness that
# benchmarks/agentx_crosscheck.py compares `loomserve bench agentx` against. It is a
# benchmarking peer only, never a loomserve dependency (it pulls ~150 packages: transformers,
# pandas, plotly, ...; about 1.5 min to install here).
#
# Also builds benchmarks/.peers/agentx-hf-cache/hub: a one-entry Hugging Face cache holding
# loomserve's converted SmolLM2 tokenizer as repo `loomserve/SmolLM2-135M-Instruct`. The harness
# needs a tokenizer to synthesize prompt text from trace hash ids; no hub downloads are possible
# here, and with HF_HUB_OFFLINE=1 agentx-harness 1.0.12 resolves even a local folder through
# `snapshot_download(local_files_only=True)` (aiperf/common/tokenizer.py,
# Tokenizer._from_pretrained_local), which rejects a filesystem path ("Repo id must be in the
# form 'repo_name'"). A cache entry with a repo id is what that code path accepts. Use:
#   HF_HUB_OFFLINE=1 HF_HUB_CACHE=benchmarks/.peers/agentx-hf-cache/hub \
#     benchmarks/.peers/agentx-venv/bin/agentx profile --tokenizer loomserve/SmolLM2-135M-Instruct ...
#
# Usage:  benchmarks/peers/agentx_harness_env.sh
# Env:    AGENTX_HARNESS_SPEC (default agentx-harness==1.0.12, the version the check was written
#         against), BASE_PYTHON (default: loomserve's .venv python, else python3),
#         TOKENIZER_DIR (default: the first ~/.cache/loomserve/SmolLM2-135M-Instruct*/ folder
#         with a tokenizer.json; run any loomserve command once to create it).
# Idempotent: reinstalls nothing when the pinned version is already there.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"          # benchmarks/
root="$(cd "$here/.." && pwd)"
venv="$here/.peers/agentx-venv"
spec="${AGENTX_HARNESS_SPEC:-agentx-harness==1.0.12}"
if [ -n "${BASE_PYTHON:-}" ]; then base_py="$BASE_PYTHON"
elif [ -x "$root/.venv/bin/python" ]; then base_py="$root/.venv/bin/python"
else base_py=python3; fi
if [ ! -x "$venv/bin/python" ]; then
  mkdir -p "$here/.peers"
  "$base_py" -m venv "$venv"
fi
want="${spec#*==}"
have="$("$venv/bin/python" -c 'from importlib.metadata import version; print(version("agentx-harness"))' 2>/dev/null || true)"
if [ "$have" != "$want" ]; then
  "$venv/bin/pip" install -q "$spec"
fi

# --- tokenizer as a local Hugging Face cache entry
tok="${TOKENIZER_DIR:-}"
if [ -z "$tok" ]; then
  for d in "$HOME"/.cache/loomserve/SmolLM2-135M-Instruct*/; do
    if [ -f "$d/tokenizer.json" ]; then tok="$d"; break; fi
  done
fi
if [ -z "$tok" ] || [ ! -f "$tok/tokenizer.json" ]; then
  echo "no SmolLM2 tokenizer.json under ~/.cache/loomserve (start a loomserve server once)" >&2
  exit 1
fi
repo="$here/.peers/agentx-hf-cache/hub/models--loomserve--SmolLM2-135M-Instruct"
rev=0000000000000000000000000000000000000000
mkdir -p "$repo/snapshots/$rev" "$repo/refs"
printf %s "$rev" > "$repo/refs/main"
cp "$tok/tokenizer.json" "$repo/snapshots/$rev/"
[ -f "$tok/tokenizer_config.json" ] && cp "$tok/tokenizer_config.json" "$repo/snapshots/$rev/"

HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_CACHE="$here/.peers/agentx-hf-cache/hub" \
  "$venv/bin/python" - <<'PY'
from importlib.metadata import version
from aiperf.common.tokenizer import Tokenizer
t = Tokenizer.from_pretrained("loomserve/SmolLM2-135M-Instruct")
assert len(t.encode("hello world")) > 0
print("agentx-harness", version("agentx-harness"), "installed; tokenizer loomserve/SmolLM2-135M-Instruct loads offline")
PY
