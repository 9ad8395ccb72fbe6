"""Compile every Triton attention kernel variant for NVIDIA targets ahead of time, on a machine
without a GPU (Triton's own ptxas): what the interpreter cannot check (tl.dot shapes, types of
loop-carried values, constexpr branches, register and shared-memory limits at compile time).
Run by tests/execution/test_triton_compile.py in a process without TRITON_INTERPRET.

    python -m tests.execution.triton_ahead [--quick] [--resources]   # a JSON line a variant

--resources adds each kernel's registers and spill stack (cuobjdump -res-usage, the one in
Triton's wheel) and its dynamic shared memory.

--quick (the test's): sm_90 only, three shapes and the split/sink corners (~20 s); the whole
set (280 variants, sm_90 and sm_80) takes ~7 minutes on the 2-core CI machine.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

TARGETS = (("sm_90", 90), ("sm_80", 80))


QUICK = (("bf16", False, (4, 128)), ("fp32", True, (2, 12)), ("bf16", True, (16, 256)))


def variants(quick: bool = False):
    """(kernel, signature, constexprs) of every combination the backend launches, the
    constexprs from the backend's own *_config functions; quick: a few shapes, each kernel's
    corners."""
    from loomserve.execution.attention import triton_kernels as k
    from loomserve.execution.attention.triton_backend import (
        decode_config,
        merge_config,
        prefill_config,
    )

    combos = QUICK if quick else itertools.product(
        ("bf16", "fp32"), (False, True), ((1, 64), (4, 128), (8, 64), (2, 12), (16, 256)))
    for dt, window, (group, hd) in combos:
        ieee = dt == "fp32"
        yield k.decode_split, _decode_sig(dt, dt), decode_config(group, hd, window, ieee)
        corners = ((False, False), (True, True)) if quick else \
            itertools.product((False, True), (False, True))
        for split, sink in corners:
            yield (k.prefill_split, _prefill_sig(dt, dt, split),
                   prefill_config(group, hd, window, sink, split, ieee))
        for sink in (True,) if quick else (False, True):
            sig = {"part_acc": "*fp32", "part_ml": "*fp32", "sink_ptr": "*fp32",
                   "o_ptr": f"*{dt}", "so_t": "i32", "so_h": "i32", "n_split": "i32",
                   "heads_total": "i32"}
            yield k.decode_merge, sig, merge_config(hd, sink)
    for kv_fp8 in (1, 2):  # 8-bit caches (uint8 views, widened by bits) under bf16 queries
        yield k.decode_split, _decode_sig("bf16", "u8"), decode_config(4, 128, False, False, kv_fp8)
        yield (k.prefill_split, _prefill_sig("bf16", "u8", True),
               prefill_config(4, 128, False, False, True, False, kv_fp8))


STRIDES = dict.fromkeys(("sq_t", "sq_h", "sk_b", "sk_o", "sk_h", "sv_b", "sv_o", "sv_h", "s_tab"),
                        "i32")


def _decode_sig(dt: str, kv: str) -> dict:
    return {"q_ptr": f"*{dt}", "k_ptr": f"*{kv}", "v_ptr": f"*{kv}", "table_ptr": "*i32",
            "lens_ptr": "*i32", "part_acc": "*fp32", "part_ml": "*fp32", **STRIDES,
            "scale": "fp32", "window": "i32", "block_size": "i32", "n_split": "i32"}


def _prefill_sig(dt: str, kv: str, split: bool) -> dict:
    part = "*fp32" if split else f"*{dt}"
    return {"q_ptr": f"*{dt}", "k_ptr": f"*{kv}", "v_ptr": f"*{kv}", "o_ptr": f"*{dt}",
            "table_ptr": "*i32", "tiles_ptr": "*i32", "sink_ptr": "*fp32",
            "part_acc": part, "part_ml": part, "sq_t": "i32", "sq_h": "i32",
            "so_t": "i32", "so_h": "i32", **{n: "i32" for n in STRIDES if n[1] in "kv"},
            "s_tab": "i32", "scale": "fp32", "window": "i32", "block_size": "i32",
            "first_row": "i32", "n_split": "i32", "heads_total": "i32"}


ALIGNED_STRIDES = {"sq_t", "sq_h", "so_t", "so_h", "sk_b", "sk_o", "sk_h", "sv_b", "sv_o", "sv_h"}


def attrs_for(fn, sig: dict, const: dict) -> dict:
    """The divisibility hints Triton's launcher would give: pointers (torch allocations, 16-byte
    aligned) and, with a head dim that is a multiple of 16, the row strides of q, out and the
    pages (the runtime specializes any integer argument divisible by 16 the same way)."""
    aligned = {n for n, t in sig.items() if t.startswith("*")}
    if const.get("HD", 0) % 16 == 0:
        aligned |= ALIGNED_STRIDES & set(sig)
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}


def compile_variant(fn, sig: dict, const: dict, cc: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig_all = {**sig, **{c: "constexpr" for c in const}}
    return triton.compile(ASTSource(fn, sig_all, constexprs=const,
                                    attrs=attrs_for(fn, sig, const)),
                          target=GPUTarget("cuda", cc, 32))


def resources(compiled) -> dict:
    """Registers and stack (spills) per thread from the cubin, dynamic shared memory."""
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    fields = dict(p.split(":") for line in out.splitlines() if "REG:" in line
                  for p in line.split() if ":" in p)
    return {"registers": int(fields.get("REG", -1)), "stack": int(fields.get("STACK", -1)),
            "shared": compiled.metadata.shared}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET"):
        print("triton_ahead: unset TRITON_INTERPRET (it compiles, not interprets)", file=sys.stderr)
        return 2
    quick = "--quick" in sys.argv[1:]
    failed = 0
    for fn, sig, const in variants(quick):
        for name, cc in TARGETS[:1] if quick else TARGETS:
            try:
                c = compile_variant(fn, sig, const, cc)
                res = {"ok": True, **(resources(c) if "--resources" in sys.argv[1:]
                                      else {"shared": c.metadata.shared})}
            except Exception as e:  # noqa: BLE001 - reported per variant
                failed += 1
                res = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            dtype = sig.get("q_ptr", sig.get("o_ptr"))[1:]
            print(json.dumps({"kernel": fn.__name__, "target": name, "dtype": dtype, **const,
                              **res}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
