"""KV transfer bandwidth on this host: the Mooncake Transfer Engine's TCP read (what a decode
instance's pull of prefilled KV runs on), beside a single-thread memcpy and a loopback TCP
socket stream.

The Transfer Engine target is a second process (its own engine and registered buffer, as a
prefill instance is); each size is read as one op, and again as a batch of page-sized ops
(--page-bytes, how KV pages move: one op per page). The TCP stream sends from a thread of this
process to a socket read with recv_into. Medians of --reps runs; GB/s = 1e9 bytes per second.

    python benchmarks/kv_transfer_bandwidth.py [--sizes-mib 1 4 16 64] [--page-bytes 262144]
        [--reps 5] [--out FILE.json] [--handshake [--model M] [--prompt-tokens 2048]]

--handshake first times the prefill/decode handshake between two engines of this process
(Mooncake backend, loopback TCP): a decode leg's time to its first token when it imports the
prompt's KV against when it computes it (medians of 3 prompts; outputs checked equal).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.host import host_info  # noqa: E402
from common.results import write_json  # noqa: E402

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")




def serve_target(nbytes: int) -> None:
    """Child: a Transfer Engine with one registered buffer; prints where, waits for stdin EOF."""
    from mooncake.engine import TransferEngine
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    assert te.register_memory(buf.data_ptr(), nbytes) == 0
    print(json.dumps({"session": f"127.0.0.1:{te.get_rpc_port()}", "addr": buf.data_ptr()}),
          flush=True)
    sys.stdin.read()


def timed(fn, reps: int) -> float:
    fn()  # warm-up (connections, page faults)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_s(n: int, reps: int) -> float:
    """One plain memcpy on one thread (numpy's copyto; torch's copy_ would split it across its
    intra-op threads, see loomserve.kv.tiers.base.copy_page)."""
    src = np.random.randint(0, 255, n, dtype=np.uint8)
    dst = np.empty_like(src)
    return timed(lambda: np.copyto(dst, src), reps)


def tcp_s(n: int, reps: int) -> float:
    payload = bytes(n)
    buf = bytearray(n)
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    out = socket.create_connection(lsock.getsockname())
    inn, _ = lsock.accept()

    def once():
        t = threading.Thread(target=out.sendall, args=(payload,))
        t.start()
        view, got = memoryview(buf), 0
        while got < n:
            got += inn.recv_into(view[got:])
        t.join()
    try:
        return timed(once, reps)
    finally:
        for s in (out, inn, lsock):
            s.close()


def mooncake_s(n: int, page: int, reps: int, target: dict, te, dst: torch.Tensor) -> tuple:
    base, raddr = dst.data_ptr(), target["addr"]
    sess = target["session"]

    def one_op():
        assert te.batch_transfer_sync_read(sess, [base], [raddr], [n]) == 0

    k = max(1, n // page)
    locs = [base + i * page for i in range(k)]
    rems = [raddr + i * page for i in range(k)]
    sizes = [page] * k

    def pages():
        assert te.batch_transfer_sync_read(sess, locs, rems, sizes) == 0
    return timed(one_op, reps), timed(pages, reps)


def handshake(model: str | None, prompt_tokens: int, reps: int) -> dict:
    """Two engines of this process with the Mooncake backend (loopback TCP): the time to the
    first token of a decode leg that imports the prompt's KV, against one that computes it."""
    import random

    from loomserve import LLM, SamplingParams
    from loomserve.engine.processor import RequestState

    kw = dict(kv_transfer_backend="mooncake", kv_cache_memory="512MiB")
    a, b = LLM(model, role="prefill", **kw), LLM(model, role="decode", **kw)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)

    def leg(llm, rid, prompt, params):
        msg = llm.inputs.make_core_request(rid, prompt, one, kv_transfer_params=params)
        state = RequestState(rid, msg.prompt_token_ids, one, llm.tokenizer)
        t0 = time.perf_counter()
        llm.core.add(msg)
        out = None
        while llm.core.has_work():
            for o in llm.core.step():
                out = state.process([o])
        return time.perf_counter() - t0, out

    rows = []
    for i in range(reps):
        prompt = [rng.randrange(100, 20000) for _ in range(prompt_tokens)]
        t_prefill, out = leg(a, f"p{i}", prompt, {"do_remote_decode": True})
        params = out.kv_transfer_params
        b.core.kv.reset_prefix_cache()
        t_import, got = leg(b, f"d{i}", prompt, params)
        b.core.kv.reset_prefix_cache()
        t_compute, ref = leg(b, f"c{i}", prompt, None)
        assert got.token_ids == ref.token_ids and got.num_tier_cached_tokens > 0
        pages = sum(len(g["addrs"]) for g in params["groups"])
        rows.append({"prefill_s": t_prefill, "decode_import_s": t_import,
                     "decode_compute_s": t_compute, "imported_tokens": got.num_cached_tokens,
                     "bytes": pages * params["page_bytes"]})
    a.close()
    b.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"prompt {prompt_tokens} tokens, KV {med['bytes'] / 2**20:.1f} MiB: prefill leg "
          f"{med['prefill_s']:.2f} s; decode leg to first token {med['decode_import_s']:.3f} s "
          f"importing, {med['decode_compute_s']:.2f} s computing")
    return {"model": model or "default", "prompt_tokens": prompt_tokens, "median": med,
            "runs": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--page-bytes", type=int, default=256 << 10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="kv_transfer_bandwidth.json", help="result file")
    ap.add_argument("--handshake", action="store_true",
                    help="also time a decode leg that imports its prompt's KV vs computes it")
    ap.add_argument("--model", default=None, help="for --handshake (default: the default model)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--serve-target", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_target:
        return serve_target(args.serve_target)
    hs = handshake(args.model, args.prompt_tokens, 3) if args.handshake else None
    from mooncake.engine import TransferEngine
    top = max(args.sizes_mib) << 20
    child = subprocess.Popen([sys.executable, __file__, "--serve-target", str(top)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        target = json.loads(child.stdout.readline())
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        dst = torch.empty(top, dtype=torch.uint8)
        assert te.register_memory(dst.data_ptr(), top) == 0
        rows = []
        print(f"{'MiB':>5} {'memcpy GB/s':>12} {'TCP GB/s':>9} {'TE 1 op':>8} "
              f"{'TE pages':>9}")
        for mib in args.sizes_mib:
            n = mib << 20
            mc, tcp = memcpy_s(n, args.reps), tcp_s(n, args.reps)
            one, paged = mooncake_s(n, args.page_bytes, args.reps, target, te, dst)
            row = {"mib": mib, "memcpy_gbps": n / mc / 1e9, "tcp_gbps": n / tcp / 1e9,
                   "mooncake_gbps": n / one / 1e9, "mooncake_pages_gbps": n / paged / 1e9}
            rows.append(row)
            print(f"{mib:>5} {row['memcpy_gbps']:>12.2f} {row['tcp_gbps']:>9.2f} "
                  f"{row['mooncake_gbps']:>8.2f} {row['mooncake_pages_gbps']:>9.2f}")
    finally:
        child.stdin.close()
        child.wait(10)
    result = {"cpu": host_info()["cpu"], "cores": os.cpu_count(), "page_bytes": args.page_bytes,
              "reps": args.reps, "date": time.strftime("%Y-%m-%d"), "rows": rows,
              "handshake": hs}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
