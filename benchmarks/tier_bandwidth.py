"""Transfer throughput of each KV tier beside this machine's memcpy and disk bandwidth.

What it measures (median of ``--repeats`` passes after one warm-up):
  * reference ``memcpy``  - torch dst.copy_(src) of a ``--copy-mib`` MiB uint8 tensor:
                            bytes copied / time (each byte is read once and written once).
  * reference ``disk``    - dd-like: write ``--pages`` x page of sequential data to one file,
                            fsync, time it; then read it back (from the page cache unless it
                            was dropped: reported as measured, see ``disk_read_cached``).
  * per tier: ``store`` = tier.put of N pages (one batch call) and ``load`` = tier.get_into of
    the same N pages, in MB/s of page payload. Tiers: host (in-process buffer), disk (one file
    per page, fsync on each), redis (redis-server on 127.0.0.1, no persistence) and mooncake
    (master + standalone storage client on 127.0.0.1, TCP, the benchmark as pure requester).
    Each pass stores fresh keys, so nothing is deduplicated. The remote tiers are skipped with
    a note when their server/package is absent.

Run:    python benchmarks/tier_bandwidth.py [--pages 64] [--page-kib 1024] [--repeats 3]
Writes: benchmarks/results/tier_bandwidth.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from common import format_table, host_info, median, write_json  # noqa: E402

from loomserve.kv.tiers import (  # noqa: E402
    DiskTier,
    HostTier,
    KeySpace,
    codec,  # noqa: E402
    layout_fingerprint,
)

MB = 1e6


def measure_memcpy(mib: int, repeats: int) -> float:
    n = mib << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return n / median(times) / MB


def measure_disk(path: str, nbytes: int, repeats: int, chunk: int = 1 << 20) -> dict:
    buf = os.urandom(chunk)
    w, r = [], []
    for _ in range(repeats + 1):
        fn = os.path.join(path, "dd.bin")
        t0 = time.perf_counter()
        fd = os.open(fn, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[:min(chunk, left)])
        os.fsync(fd)
        os.close(fd)
        w.append(time.perf_counter() - t0)
        dropped = False
        try:  # drop this file's pages from the cache if the kernel lets us
            fd = os.open(fn, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            dropped = True
        except (AttributeError, OSError):
            pass
        t0 = time.perf_counter()
        with open(fn, "rb", buffering=0) as f:
            while f.read(chunk):
                pass
        r.append(time.perf_counter() - t0)
        os.unlink(fn)
    w, r = w[1:], r[1:]
    return {"write_fsync_mbs": nbytes / median(w) / MB, "read_mbs": nbytes / median(r) / MB,
            "fadvise_dontneed": dropped}


def bench_tier(tier, ks: KeySpace, pages: torch.Tensor, repeats: int) -> dict:
    n, pb = pages.shape
    out = torch.empty_like(pages)
    st, ld, ok_all = [], [], True
    for rep in range(repeats + 1):
        keys = ks.keys([rep.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(n)])
        t0 = time.perf_counter()
        ok = tier.put(keys, pages)
        t1 = time.perf_counter()
        got = tier.get_into(keys, out)
        t2 = time.perf_counter()
        ok_all &= all(ok) and all(got) and torch.equal(out, pages)
        if rep:
            st.append(t1 - t0)
            ld.append(t2 - t1)
        tier.remove(keys)
    return {"store_mbs": n * pb / median(st) / MB, "load_mbs": n * pb / median(ld) / MB,
            "store_ms_per_page": median(st) / n * 1e3, "load_ms_per_page": median(ld) / n * 1e3,
            "bit_exact": bool(ok_all)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-kib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--copy-mib", type=int, default=512)
    ap.add_argument("--dir", default=None, help="disk tier directory (default: a temp dir)")
    ap.add_argument("--no-remote", action="store_true", help="skip redis and mooncake")
    args = ap.parse_args()

    pb = args.page_kib << 10
    n = args.pages
    pages = torch.randint(0, 256, (n, pb), dtype=torch.uint8)
    ks = KeySpace(layout_fingerprint("bench", "uint8", 16, pb))
    tmp = tempfile.mkdtemp(prefix="tier-bw-", dir=args.dir)
    result = {"host": host_info(), "pages": n, "page_bytes": pb, "repeats": args.repeats,
              "cuda": torch.cuda.is_available(), "reference": {}, "tiers": {}, "skipped": {}}

    result["reference"]["memcpy_mbs"] = measure_memcpy(args.copy_mib, args.repeats)
    result["reference"]["disk"] = measure_disk(tmp, n * pb, args.repeats)

    tiers = [("host", lambda: HostTier(n * pb, pb)),
             ("disk", lambda: DiskTier(os.path.join(tmp, "tier"), 2 * n * (pb + codec.HEADER_BYTES),
                                       pb))]
    services = []
    if not args.no_remote:
        from loomserve.control.store_launcher import MooncakeService, RedisService
        try:
            from loomserve.kv.tiers.redis_tier import RedisTier
            rs = RedisService().start()
            services.append(rs)
            tiers.append(("redis", lambda: RedisTier(pb, url=rs.url, timeout_s=30)))
        except (ImportError, FileNotFoundError, RuntimeError, TimeoutError) as e:
            result["skipped"]["redis"] = str(e)
        try:
            from loomserve.kv.tiers.mooncake_tier import MooncakeTier, import_store
            import_store()
            mc = MooncakeService(segment_bytes=max(256 << 20, 4 * n * pb)).start()
            services.append(mc)
            tiers.append(("mooncake", lambda: MooncakeTier(mc.master_address, pb,
                                                           staging_pages=min(n, 64))))
        except (ImportError, FileNotFoundError, RuntimeError, TimeoutError) as e:
            result["skipped"]["mooncake"] = str(e)
    try:
        for name, make in tiers:
            tier = make()
            try:
                result["tiers"][name] = bench_tier(tier, ks, pages, args.repeats)
            finally:
                tier.close()
    finally:
        for s in services:
            s.stop()

    ref = result["reference"]
    rows = [["memcpy (torch copy_)", f"{ref['memcpy_mbs']:.0f}", f"{ref['memcpy_mbs']:.0f}", ""],
            ["disk (dd: write+fsync / read)", f"{ref['disk']['write_fsync_mbs']:.0f}",
             f"{ref['disk']['read_mbs']:.0f}",
             "" if ref["disk"]["fadvise_dontneed"] else "read may hit page cache"]]
    for name, r in result["tiers"].items():
        rows.append([f"tier {name}", f"{r['store_mbs']:.0f}", f"{r['load_mbs']:.0f}",
                     "bit-exact" if r["bit_exact"] else "MISMATCH"])
    for name, why in result["skipped"].items():
        rows.append([f"tier {name}", "-", "-", f"skipped: {why[:60]}"])
    print(f"{n} pages of {pb >> 10} KiB, median of {args.repeats}; MB/s of payload")
    print(format_table(["path", "store/write MB/s", "load/read MB/s", "note"], rows))
    path = write_json("tier_bandwidth.json", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
