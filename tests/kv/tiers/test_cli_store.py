"""`loomserve store` (loomserve/control/store_launcher.py): starts the pool on 127.0.0.1, prints
where, serves, stops on Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys

import torch

from loomserve.cli import build_parser
from loomserve.control.store_launcher import free_port, parse_size

from .conftest import PAGE, block_hashes, pages, require_mooncake, require_redis


def test_store_subcommand_is_registered():
    args = build_parser().parse_args(["store", "--segment-size", "64MB", "--port", "1234"])
    assert args.command == "store" and args.port == 1234 and args.backend == "mooncake"
    assert build_parser().parse_args(["store"]).port is None  # 50051, or 6379 for redis
    assert parse_size("64MB") == 64 << 20 and parse_size("1.5GiB") == 3 << 29
    assert parse_size("4096") == 4096


def test_loomserve_store_runs_mooncake_and_stops_on_ctrl_c(ks, tmp_path):
    require_mooncake()
    from loomserve.kv.tiers.mooncake_tier import MooncakeTier
    port, cport = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "loomserve", "store", "--port", str(port), "--client-port",
         str(cport), "--segment-size", "32MB", "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert f"mooncake master on 127.0.0.1:{port}" in line, line
        assert f"storage client on 127.0.0.1:{cport}" in line
        tier = MooncakeTier(f"127.0.0.1:{port}", PAGE)
        keys = ks.keys(block_hashes(2, tag=21))
        src = pages(2, seed=21)
        assert tier.put(keys, src) == [True, True]
        out = torch.zeros_like(src)
        assert tier.get_into(keys, out) == [True, True] and torch.equal(out, src)
        tier.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_loomserve_store_runs_redis_on_the_given_port(ks):
    require_redis()
    from loomserve.kv.tiers.redis_tier import RedisTier
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "loomserve", "store", "--backend", "redis", "--port", str(port),
         "--segment-size", "16MB"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert f"redis-server on 127.0.0.1:{port}" in line, line
        tier = RedisTier(PAGE, url=f"redis://127.0.0.1:{port}/0")
        keys = ks.keys(block_hashes(2, tag=22))
        src = pages(2, seed=22)
        assert tier.put(keys, src) == [True, True]
        out = torch.zeros_like(src)
        assert tier.get_into(keys, out) == [True, True] and torch.equal(out, src)
        tier.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
