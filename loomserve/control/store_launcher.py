"""`loomserve store` and the services behind it: the shared KV pool's processes.

MooncakeService runs a `mooncake_master` (metadata) and one standalone `mooncake_client` that
owns the pool memory (its global segment), TCP transport, peer-to-peer handshake (no etcd);
engines connect to the master as pure requesters (MooncakeTier, global_segment_size=0).
RedisService runs one redis-server without persistence. Both bind one address (127.0.0.1 by
default). `add_store_parser` registers the subcommand (loomserve/cli.py calls it);
tests and benchmarks start the services directly. Imports nothing else from loomserve.

The transfer engine inside mooncake_client also opens a handshake port and a TCP data port on
ephemeral ports, listening on all addresses whatever --host says (MC_TCP_BIND_ADDRESS only picks
the address it advertises): firewall the host if that matters.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_port(host: str, port: int, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening on "
                               f"{host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{what} did not listen on {host}:{port} within {timeout}s")


def _stop(proc: subprocess.Popen | None, sig=signal.SIGTERM, timeout: float = 5.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(sig)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)
    except ProcessLookupError:
        pass


def find_mooncake_binary(name: str) -> str | None:
    """mooncake_master / mooncake_client: on PATH, beside this Python, or in the package."""
    for cand in (shutil.which(name), Path(sys.executable).with_name(name)):
        if cand and Path(cand).is_file():
            return str(cand)
    try:
        import importlib.util
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        spec = None
    if spec and spec.submodule_search_locations:
        for d in spec.submodule_search_locations:
            p = Path(d) / name
            if p.is_file():
                return str(p)
    return None


def parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    t = text.strip().upper().replace(" ", "")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    for suffix in ("IB", "B"):
        if t.endswith(suffix) and t[:-len(suffix)][-1:] in units:
            t = t[:-len(suffix)]
            break
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t.rstrip("B"))


class MooncakeService:
    """A mooncake_master and one standalone mooncake_client (the storage) as child processes."""

    def __init__(self, host: str = "127.0.0.1", master_port: int = 0, client_port: int = 0,
                 segment_bytes: int = 256 << 20, metrics_port: int = 0,
                 log_dir: str | os.PathLike | None = None,
                 master_args: tuple[str, ...] = ()) -> None:
        self.master_bin = find_mooncake_binary("mooncake_master")
        self.client_bin = find_mooncake_binary("mooncake_client")
        if not self.master_bin or not self.client_bin:
            raise FileNotFoundError(
                "mooncake_master/mooncake_client not found: pip install "
                "mooncake-transfer-engine-non-cuda (and apt-get install libibverbs1)")
        self.host = host
        self.master_port = master_port or free_port(host)
        self.client_port = client_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.segment_bytes = segment_bytes
        self.master_args = tuple(master_args)
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="mooncake-"))
        self.master: subprocess.Popen | None = None
        self.client: subprocess.Popen | None = None
        self._env = {**os.environ, "MC_TCP_BIND_ADDRESS": host}

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.master_port}"

    @property
    def client_address(self) -> str:
        return f"{self.host}:{self.client_port}"

    def _log(self, name: str):
        return open(self.log_dir / f"{name}.log", "ab")

    def start_master(self, timeout: float = 15.0) -> None:
        args = [self.master_bin, f"--rpc_address={self.host}", f"--rpc_port={self.master_port}",
                f"--metrics_host={self.host}", f"--metrics_port={self.metrics_port}",
                "--enable_http_metadata_server=false", "--logtostderr", *self.master_args]
        with self._log("master") as log:
            self.master = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, env=self._env,
                                           start_new_session=True)
        _wait_port(self.host, self.master_port, self.master, timeout, "mooncake_master")

    def start_client(self, timeout: float = 15.0) -> None:
        args = [self.client_bin, f"--host={self.host}", f"--port={self.client_port}",
                f"--master_server_address={self.master_address}",
                "--metadata_server=P2PHANDSHAKE", f"--global_segment_size={self.segment_bytes}",
                "--protocol=tcp", "--logtostderr"]
        with self._log("client") as log:
            self.client = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, env=self._env,
                                           start_new_session=True)
        # It serves its port only after its segment is mounted at the master.
        _wait_port(self.host, self.client_port, self.client, timeout, "mooncake_client")

    def start(self, timeout: float = 15.0) -> "MooncakeService":
        self.start_master(timeout)
        try:
            self.start_client(timeout)
        except Exception:
            self.stop()
            raise
        return self

    def kill_master(self) -> None:
        _stop(self.master, signal.SIGKILL)

    def kill_client(self) -> None:
        _stop(self.client, signal.SIGKILL)

    def stop(self) -> None:
        _stop(self.client)
        _stop(self.master)

    def alive(self) -> bool:
        return all(p is not None and p.poll() is None for p in (self.master, self.client))

    def describe(self) -> str:
        return (f"mooncake master on {self.master_address} (metrics http://{self.host}:"
                f"{self.metrics_port}), storage client on {self.client_address} with a "
                f"{self.segment_bytes} byte segment; logs in {self.log_dir}\n"
                f"engines connect with MooncakeTier(master_address='{self.master_address}', ...)")

    def __enter__(self) -> "MooncakeService":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisService:
    """A redis-server child process: no persistence, bound to host, optional maxmemory."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, maxmemory: int = 0,
                 policy: str = "allkeys-lru") -> None:
        self.bin = shutil.which("redis-server")
        if not self.bin:
            raise FileNotFoundError("redis-server not found: apt-get install redis-server")
        self.host = host
        self.port = port or free_port(host)
        self.maxmemory = maxmemory
        self.policy = policy
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisService":
        args = [self.bin, "--bind", self.host, "--port", str(self.port), "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes",
                "--loglevel", "warning", "--maxmemory", str(self.maxmemory),
                "--maxmemory-policy", self.policy]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        _wait_port(self.host, self.port, self.proc, timeout, "redis-server")
        return self

    def kill(self) -> None:
        _stop(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        _stop(self.proc)

    def describe(self) -> str:
        return (f"redis-server on {self.host}:{self.port} (no persistence, maxmemory "
                f"{self.maxmemory or 'unlimited'}, {self.policy}); engines connect with "
                f"RedisTier(url='{self.url}', ...)")

    def __enter__(self) -> "RedisService":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# -- `loomserve store` --------------------------------------------------------------------------
def add_store_parser(sub) -> None:
    p = sub.add_parser("store", help="run the shared KV pool (Mooncake Store or Redis)",
                       description="Start the shared KV pool on one address and wait; Ctrl-C "
                                   "stops it. Mooncake: a master plus a standalone storage client "
                                   "that owns the memory. Redis: one redis-server.")
    p.add_argument("--backend", choices=["mooncake", "redis"], default="mooncake",
                   help="Mooncake Store (master + storage client) or one redis-server "
                        "(default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=None, metavar="PORT",
                   help="mooncake master RPC port / redis port (default: 50051 / 6379)")
    p.add_argument("--client-port", type=int, default=50052, metavar="PORT",
                   help="mooncake storage client port (default: %(default)s)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="mooncake master metrics port (default: a free one)")
    p.add_argument("--segment-size", default="4GB", metavar="SIZE",
                   help="pool memory: mooncake storage segment / redis maxmemory "
                        "(default: %(default)s)")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="mooncake logs (default: a temp dir)")
    p.set_defaults(func=run_store)


def run_store(args: argparse.Namespace) -> int:
    size = parse_size(args.segment_size)
    try:
        if args.backend == "redis":
            svc = RedisService(args.host, args.port or 6379, maxmemory=size)
        else:
            svc = MooncakeService(args.host, args.port or 50051, args.client_port, size,
                                  args.metrics_port, args.log_dir)
        svc.start()
    except (FileNotFoundError, RuntimeError, TimeoutError) as e:
        print(f"loomserve store: error: {e}", file=sys.stderr)
        return 1
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    # handlers before the ready line: a supervisor may signal as soon as it reads it
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    print("loomserve store: " + svc.describe(), flush=True)
    rc = 0
    try:
        procs = ([svc.proc] if isinstance(svc, RedisService) else [svc.master, svc.client])
        while not stop["now"]:
            if any(p.poll() is not None for p in procs):
                print("loomserve store: a pool process exited; stopping", file=sys.stderr)
                rc = 1  # a supervisor should see a pool that died as a failure
                break
            time.sleep(0.2)
    finally:
        svc.stop()
        for s, h in old.items():
            signal.signal(s, h)
    print("loomserve store: stopped", flush=True)
    return rc
