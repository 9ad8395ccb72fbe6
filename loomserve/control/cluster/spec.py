"""What a cluster is: its instances and its router, from a YAML file or from flags, and the
command line that starts each of them.

YAML (every key but `instances` optional):

    model: /models/SmolLM2          # what every instance serves (default: the built-in model)
    serve_args: [--dtype, float32]  # appended to every `loomserve serve`
    kv_events_base_port: 5557       # instance i publishes on base + 2i (replay on + 1) unless
                                    # it says kv_events_port; `kv_events: false` turns them off
    instances:
      - name: prefill-0             # unique; default instance-<i>
        host: 10.0.0.5              # the address others reach it at (default 127.0.0.1)
        bind: 0.0.0.0               # what it listens on (default: host)
        port: 8100                  # required (flags: base port + i)
        role: prefill               # both | prefill | decode (default both)
        kv_events_port: 5557
        model: /models/other        # overrides the file's model
        args: [--kv-cache-memory, 4GiB]
        node: gpu-a                 # machine name for `--node` (default: "local")
    router:                         # `router: null` or `--no-router`: no router
      host: 127.0.0.1
      port: 9000
      policy: default
      args: []
      node: gpu-a                   # default: the first instance's node

Invariants: names are unique; no two instances on the same host share a port, including their
KV event and replay ports and the router's; every role is one of both|prefill|decode. Loading
never starts anything. Imports nothing else from loomserve.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field

ROLES = ("both", "prefill", "decode")
DEFAULT_NODE = "local"
_TOP_KEYS = {"model", "serve_args", "kv_events", "kv_events_base_port", "instances", "router"}
_INSTANCE_KEYS = {"name", "host", "bind", "port", "role", "kv_events_port", "model", "args",
                  "node"}
_ROUTER_KEYS = {"host", "bind", "port", "policy", "args", "node"}


class SpecError(ValueError):
    """A cluster file or flag set that cannot describe a cluster; the message names the key."""


@dataclass
class InstanceSpec:
    name: str
    port: int
    host: str = "127.0.0.1"
    bind: str | None = None
    role: str = "both"
    kv_events_port: int | None = None
    model: str | None = None
    args: list[str] = field(default_factory=list)
    node: str = DEFAULT_NODE

    @property
    def listen(self) -> str:
        return self.bind or self.host

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        """The ZMQ PUB bind address (a wildcard bind publishes on every address)."""
        if self.kv_events_port is None:
            return None
        host = "*" if self.listen in ("0.0.0.0", "*") else self.listen
        return f"tcp://{host}:{self.kv_events_port}"


@dataclass
class RouterSpec:
    port: int = 9000
    host: str = "127.0.0.1"
    bind: str | None = None
    policy: str = "default"
    args: list[str] = field(default_factory=list)
    node: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class ClusterSpec:
    instances: list[InstanceSpec]
    router: RouterSpec | None = None
    model: str | None = None
    serve_args: list[str] = field(default_factory=list)

    def nodes(self) -> list[str]:
        return sorted({i.node for i in self.instances} | ({self.router.node} if self.router
                                                           else set()))

    def on_node(self, node: str | None) -> tuple[list[InstanceSpec], bool]:
        """The instances `node` starts and whether it starts the router (None: everything)."""
        if node is None:
            return list(self.instances), self.router is not None
        if node not in self.nodes():
            raise SpecError(f"--node {node!r} is not in the file (nodes: "
                            f"{', '.join(self.nodes())})")
        return ([i for i in self.instances if i.node == node],
                self.router is not None and self.router.node == node)

    def instance_command(self, inst: InstanceSpec, python: str = sys.executable) -> list[str]:
        """`python -m loomserve serve ...`; the instance's own args come last (they win)."""
        model = inst.model or self.model
        cmd = [python, "-m", "loomserve", "serve", *([model] if model else []),
               "--host", inst.listen, "--port", str(inst.port), "--role", inst.role]
        if inst.kv_events_endpoint:
            cmd += ["--kv-events-endpoint", inst.kv_events_endpoint]
        if inst.role != "both":  # peers pull or push KV at the address the instance is reached at
            cmd += ["--kv-transfer-host", inst.host]
        return cmd + list(self.serve_args) + list(inst.args)

    def router_command(self, python: str = sys.executable) -> list[str]:
        r = self.router
        if r is None:
            raise SpecError("this cluster has no router")
        cmd = [python, "-m", "loomserve", "router"]
        for inst in self.instances:
            cmd += ["--instance", inst.url]
        return cmd + ["--policy", r.policy, "--host", r.bind or r.host, "--port", str(r.port),
                      *r.args]


def _args(value, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, list) and all(isinstance(a, (str, int, float)) for a in value):
        return [str(a) for a in value]
    raise SpecError(f"{where}: expected a list of arguments or one string")


def _port(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise SpecError(f"{where}: expected a port number, got {value!r}")
    return value


def _keys(d, allowed: set[str], where: str) -> dict:
    if not isinstance(d, dict):
        raise SpecError(f"{where}: expected a mapping")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise SpecError(f"{where}: unknown key(s) {', '.join(unknown)} "
                        f"(known: {', '.join(sorted(allowed))})")
    return d


def _instance(d, i: int, events_base: int | None) -> InstanceSpec:
    where = f"instances[{i}]"
    d = _keys(d, _INSTANCE_KEYS, where)
    if "port" not in d:
        raise SpecError(f"{where}.port: missing")
    role = d.get("role", "both")
    if role not in ROLES:
        raise SpecError(f"{where}.role: one of {', '.join(ROLES)}, got {role!r}")
    kv = d.get("kv_events_port")
    if kv is not None:
        kv = _port(kv, f"{where}.kv_events_port")
    elif events_base is not None:
        kv = events_base + 2 * i
    return InstanceSpec(name=str(d.get("name", f"instance-{i}")),
                        port=_port(d["port"], f"{where}.port"), host=str(d.get("host",
                                                                              "127.0.0.1")),
                        bind=d.get("bind"), role=role, kv_events_port=kv, model=d.get("model"),
                        args=_args(d.get("args"), f"{where}.args"),
                        node=str(d.get("node", DEFAULT_NODE)))


def spec_from_dict(doc) -> ClusterSpec:
    """A ClusterSpec from a parsed YAML document (validated: see the module docstring)."""
    doc = _keys(doc, _TOP_KEYS, "cluster file")
    raw = doc.get("instances")
    if not isinstance(raw, list) or not raw:
        raise SpecError("instances: expected a non-empty list")
    base = None
    if doc.get("kv_events", True):
        base = _port(doc.get("kv_events_base_port", 5557), "kv_events_base_port")
    instances = [_instance(d, i, base) for i, d in enumerate(raw)]
    router = None
    if doc.get("router", {}) is not None:
        r = _keys(doc.get("router", {}), _ROUTER_KEYS, "router")
        router = RouterSpec(port=_port(r.get("port", 9000), "router.port"),
                            host=str(r.get("host", "127.0.0.1")), bind=r.get("bind"),
                            policy=str(r.get("policy", "default")),
                            args=_args(r.get("args"), "router.args"),
                            node=str(r.get("node", instances[0].node)))
    spec = ClusterSpec(instances, router, doc.get("model"),
                       _args(doc.get("serve_args"), "serve_args"))
    validate(spec)
    return spec


def load_spec(path: str) -> ClusterSpec:
    import yaml
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise SpecError(f"cannot read {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise SpecError(f"{path} is not valid YAML: {e}") from e
    try:
        return spec_from_dict(doc)
    except SpecError as e:
        raise SpecError(f"{path}: {e}") from e


def spec_from_counts(both: int = 0, prefill: int = 0, decode: int = 0, *, model=None,
                     host="127.0.0.1", base_port=8100, kv_events_base_port: int | None = 5557,
                     router_port: int | None = 9000, policy="default",
                     serve_args=()) -> ClusterSpec:
    """Flags mode: prefill instances first, then decode, then both, on consecutive ports."""
    roles = ["prefill"] * prefill + ["decode"] * decode + ["both"] * both
    if not roles:
        raise SpecError("no instance: give --instances N, or --prefill N and --decode N")
    counters: dict[str, int] = {}
    instances = []
    for i, role in enumerate(roles):
        k = counters[role] = counters.get(role, -1) + 1
        name = f"instance-{k}" if role == "both" else f"{role}-{k}"
        instances.append(InstanceSpec(name, base_port + i, host, role=role, kv_events_port=(
            None if kv_events_base_port is None else kv_events_base_port + 2 * i)))
    router = None if router_port is None else RouterSpec(router_port, host, policy=policy,
                                                         node=DEFAULT_NODE)
    spec = ClusterSpec(instances, router, model, list(serve_args))
    validate(spec)
    return spec


def validate(spec: ClusterSpec) -> None:
    names = [i.name for i in spec.instances]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SpecError(f"instance names must be unique: {', '.join(dup)}")
    taken: dict[tuple[str, int], str] = {}

    def take(host: str, port: int, what: str) -> None:
        if (host, port) in taken:
            raise SpecError(f"port {port} on {host} is used twice: {taken[host, port]} and {what}")
        taken[host, port] = what

    for inst in spec.instances:
        take(inst.host, inst.port, inst.name)
        if inst.kv_events_port is not None:
            take(inst.host, inst.kv_events_port, f"{inst.name} KV events")
            take(inst.host, inst.kv_events_port + 1, f"{inst.name} KV events replay")
    if spec.router is not None:
        take(spec.router.host, spec.router.port, "the router")
