"""`loomserve cluster`: N instances and the router from one command.

    loomserve cluster --instances 3                      # three role-both instances + router
    loomserve cluster --prefill 1 --decode 2 -- --dtype float32
    loomserve cluster --config deploy/cluster.example.yaml [--node NAME] [--dry-run]

Flags mode puts instance i on --base-port + i and its KV events on --kv-events-base-port + 2i
(replay + 1). With --config, the same file serves every machine of a multi-machine deployment:
each runs `loomserve cluster --config FILE --node ITS_NODE` and starts only its instances; the
router's node also starts the router with every instance's URL. Logs go to --log-dir, one file
per process, with cluster.json (names, pids, health URLs) beside them.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

from loomserve.control.cluster.spec import ClusterSpec, SpecError, load_spec, spec_from_counts
from loomserve.control.cluster.supervisor import Child, StartError, Supervisor

__all__ = ["add_cluster_parser", "run_cluster", "spec_from_args"]


def add_cluster_parser(sub) -> None:
    p = sub.add_parser("cluster", help="start N instances and the router on this machine",
                       description=__doc__.splitlines()[0],
                       epilog="Arguments after `--` go to every `loomserve serve`.")
    p.add_argument("--config", metavar="YAML",
                   help="cluster file (see deploy/cluster.example.yaml)")
    p.add_argument("--node", help="with --config: start only this node's instances (and the "
                                  "router when it is the router's node)")
    p.add_argument("--instances", type=int, default=None, metavar="N",
                   help="N instances of role both (default without --config: 2)")
    p.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="N instances of role prefill (default: %(default)s)")
    p.add_argument("--decode", type=int, default=0, metavar="N",
                   help="N instances of role decode (default: %(default)s)")
    p.add_argument("--model", help="model folder or .gguf for every instance (default: the "
                                   "cluster file's, else the built-in model)")
    p.add_argument("--host", default="127.0.0.1", help="flags mode: address to listen on "
                                                       "(default: %(default)s)")
    p.add_argument("--base-port", type=int, default=8100, metavar="PORT",
                   help="flags mode: instance i listens on PORT + i (default: %(default)s)")
    p.add_argument("--kv-events-base-port", type=int, default=5557, metavar="PORT",
                   help="flags mode: instance i publishes KV events on PORT + 2i, replay on the "
                        "next port; 0: off (default: %(default)s)")
    p.add_argument("--router-port", type=int, default=9000, metavar="PORT",
                   help="the router's port (default: %(default)s)")
    p.add_argument("--policy", default="default",
                   help="the router's --policy (default: %(default)s)")
    p.add_argument("--no-router", action="store_true", help="start the instances only")
    p.add_argument("--restart", action="store_true",
                   help="restart an instance that exits (after 1, 2, 4, ... 30 s)")
    p.add_argument("--log-dir", help="one log per process and cluster.json "
                                     "(default: a new temp dir)")
    p.add_argument("--start-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="most time an instance may take to be healthy (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    p.add_argument("serve_args", nargs=argparse.REMAINDER,
                   help="after --: extra `loomserve serve` arguments for every instance")
    p.set_defaults(func=run_cluster)


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    extra = list(args.serve_args or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]
    if args.config:
        if args.instances is not None or args.prefill or args.decode:
            raise SpecError("--config describes the instances: drop --instances/--prefill/"
                            "--decode")
        spec = load_spec(args.config)
        if args.model:
            spec.model = args.model
        spec.serve_args += extra
        if args.no_router:
            spec.router = None
        return spec
    if args.node:
        raise SpecError("--node needs --config")
    both = args.instances if args.instances is not None else (
        0 if args.prefill or args.decode else 2)
    return spec_from_counts(both, args.prefill, args.decode, model=args.model, host=args.host,
                            base_port=args.base_port,
                            kv_events_base_port=args.kv_events_base_port or None,
                            router_port=None if args.no_router else args.router_port,
                            policy=args.policy, serve_args=extra)


def _children(spec: ClusterSpec, node: str | None, log_dir: Path) -> tuple[list[Child],
                                                                            Child | None]:
    instances, with_router = spec.on_node(node)
    kids = [Child(i.name, spec.instance_command(i), log_dir / f"{i.name}.log",
                  f"http://{_local(i.listen)}:{i.port}/health") for i in instances]
    router = None
    if with_router:
        r = spec.router
        router = Child("router", spec.router_command(), log_dir / "router.log",
                       f"http://{_local(r.bind or r.host)}:{r.port}/health", any_status=True)
    return kids, router


def _local(addr: str) -> str:
    """Where this machine reaches what it binds on `addr` (a wildcard: the loopback)."""
    return "127.0.0.1" if addr in ("0.0.0.0", "*", "") else addr


def table(spec: ClusterSpec, node: str | None, sup: Supervisor | None = None) -> str:
    instances, with_router = spec.on_node(node)
    pids = {c.name: c.pid for c in sup.children()} if sup else {}
    rows = [("NAME", "ROLE", "NODE", "URL", "KV EVENTS", "PID")]
    for i in instances:
        ev = f"tcp://{i.host}:{i.kv_events_port}" if i.kv_events_port else "-"
        rows.append((i.name, i.role, i.node, i.url, ev, str(pids.get(i.name) or "-")))
    if with_router:
        rows.append(("router", spec.router.policy, spec.router.node, spec.router.url, "-",
                     str(pids.get("router") or "-")))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def run_cluster(args: argparse.Namespace) -> int:
    try:
        spec = spec_from_args(args)
        kids, router = _children(spec, args.node, Path(args.log_dir or "."))
    except SpecError as e:
        print(f"loomserve cluster: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for c in kids + ([router] if router else []):
            print(f"# {c.name}\n{shlex.join(c.cmd)}")
        return 0
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="loomserve-cluster-"))
    kids, router = _children(spec, args.node, log_dir)
    sup = Supervisor(kids, router, restart=args.restart, start_timeout=args.start_timeout,
                     log=lambda s: print(s, file=sys.stderr, flush=True))
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    rc = 0
    try:
        print(f"loomserve cluster: starting {len(kids)} instance(s)"
              + (" and the router" if router else "") + f"; logs in {log_dir}", flush=True)
        sup.start()
        sup.write_state(log_dir / "cluster.json")
        print(table(spec, args.node, sup), flush=True)
        print("loomserve cluster: ready" + (f"; send requests to {spec.router.url}" if router
                                            else ""), flush=True)
        while stop["signal"] is None:
            rc = sup.watch_once()
            if rc is not None:
                break
            sup.write_state(log_dir / "cluster.json")
            time.sleep(0.5)
        rc = rc or 0
    except StartError as e:
        print(f"loomserve cluster: error: {e}", file=sys.stderr)
        rc = 1
    finally:
        sup.stop()
        for s, h in old.items():
            signal.signal(s, h)
    print("loomserve cluster: stopped", flush=True)
    return rc
