"""P/D sizing on this host: `loomserve bench pd-profile` against one co-located instance of the
default model, saved with its host (the product's tool profiles a URL; the CPU that matters is
the server's, here the same machine's).

    python benchmarks/pd_profile.py [--input-len 1024] [--output-len 64] [--max-concurrency 16]
        [--dtype float32] [--out pd_profile.json]

Writes benchmarks/results/pd_profile.json (and pd_profile.png beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, ServerProcess, free_port, which_loomserve, write_json  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="pd_profile.json")
    a = ap.parse_args()
    port = free_port()
    serve = [*which_loomserve(), "serve", "--port", str(port), "--dtype", a.dtype]
    plot = os.path.join(RESULTS_DIR, os.path.splitext(os.path.basename(a.out))[0] + ".png")
    with ServerProcess(serve, port, name="loomserve"), tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "profile.json")
        subprocess.run([*which_loomserve(), "bench", "pd-profile", "--prefill",
                        f"http://127.0.0.1:{port}", "--input-len", str(a.input_len),
                        "--output-len", str(a.output_len), "--max-concurrency",
                        str(a.max_concurrency), "--plot", plot, "--out", raw], check=True)
        with open(raw) as f:
            result = json.load(f)
    result["plot"] = "benchmarks/results/" + os.path.basename(plot)
    result["server"] = {"command": serve, "dtype": a.dtype}
    print("wrote", write_json(a.out, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
