"""deploy/: every YAML parses; the Kubernetes objects hang together (selectors match pod labels,
the headless Service names the StatefulSet, the router lists every replica by its stable DNS
name); every container's arguments parse with the real `loomserve serve` / `loomserve router`
parsers and its ports are the ones those arguments listen on; the cluster files load and give
commands `loomserve serve` accepts; the llm-d values point at the same ports and labels."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from loomserve.cli import build_parser
from loomserve.control.cluster.spec import spec_from_dict

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "kubernetes"
KINDS = {"Service", "StatefulSet", "Deployment", "ConfigMap", "PersistentVolumeClaim",
         "Kustomization"}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _objects() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml")) for d in _docs(p)]


def _workloads():
    return [(f, d) for f, d in _objects() if d["kind"] in ("StatefulSet", "Deployment")]


def _parse(container: dict):
    """The container's command line through loomserve's own parser ($(VAR) filled in)."""
    cmd = container["command"] + container.get("args", [])
    assert cmd[0] == "loomserve", cmd
    argv = [a.replace("$(POD_IP)", "10.1.2.3") for a in cmd[1:]]
    return build_parser().parse_args(argv)


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def test_every_yaml_under_deploy_parses():
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 8
    for f in files:
        assert _docs(f), f


def test_kubernetes_objects_are_known_kinds_with_names():
    objs = _objects()
    assert {d["kind"] for _, d in objs} <= KINDS
    for f, d in objs:
        assert d.get("apiVersion"), f
        if d["kind"] != "Kustomization":
            assert d["metadata"]["name"], f
    kust = next(d for _, d in objs if d["kind"] == "Kustomization")
    assert all((K8S / r).is_file() for r in kust["resources"])


def test_instance_containers_parse_and_expose_their_ports():
    serve = [(f, d, c) for f, d in _workloads()
             for c in d["spec"]["template"]["spec"]["containers"] if c["command"][1] == "serve"]
    assert len(serve) == 3  # instances.yaml, and pd.yaml's prefill and decode
    roles = set()
    for f, d, c in serve:
        args, ports = _parse(c), _ports(c)
        roles.add(args.role)
        assert args.host == "0.0.0.0" and args.port == ports["http"], f
        ev = urlsplit(args.kv_events_endpoint)
        assert ev.scheme == "tcp" and ev.hostname == "*" and ev.port == ports["kv-events"]
        assert ports["kv-replay"] == ev.port + 1  # the default replay endpoint
        assert d["kind"] == "StatefulSet"
        for probe in ("readinessProbe", "startupProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, (f, probe)
        assert c["resources"]["requests"] and c["resources"]["limits"]
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert any(args.model.startswith(m + "/") for m in mounts), "model on a mounted volume"
        if args.role != "both":
            assert args.kv_transfer_host == "10.1.2.3"  # the pod IP peers reach
    assert roles == {"both", "prefill", "decode"}


def _services() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in _objects() if d["kind"] == "Service"}


def test_selectors_match_pod_labels_and_headless_services_expose_events():
    services = _services()
    for f, d in _workloads():
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items(), f
        if d["kind"] == "StatefulSet":
            svc = services[d["spec"]["serviceName"]]
            assert svc["spec"]["clusterIP"] == "None"
            assert svc["spec"]["selector"].items() <= labels.items()
            assert {p["port"] for p in svc["spec"]["ports"]} == {8000, 5557, 5558}
    for name, svc in services.items():
        assert any(svc["spec"]["selector"].items()
                   <= d["spec"]["template"]["metadata"]["labels"].items()
                   for _, d in _workloads()), f"service {name} selects no pod"


def _replica_urls() -> dict[str, set[str]]:
    """headless service -> the URL of every replica of the StatefulSets behind it."""
    out: dict[str, set[str]] = {}
    for _, d in _workloads():
        if d["kind"] == "StatefulSet":
            svc, name = d["spec"]["serviceName"], d["metadata"]["name"]
            port = _ports(d["spec"]["template"]["spec"]["containers"][0])["http"]
            out.setdefault(svc, set()).update(
                f"http://{name}-{i}.{svc}:{port}" for i in range(d["spec"]["replicas"]))
    return out


def test_routers_list_every_replica_by_its_stable_name():
    replicas = _replica_urls()
    routers = [(f, c) for f, d in _workloads()
               for c in d["spec"]["template"]["spec"]["containers"] if c["command"][1] == "router"]
    assert len(routers) == 2
    for f, c in routers:
        args = _parse(c)
        assert args.port == _ports(c)["http"] and args.host == "0.0.0.0"
        svc = urlsplit(args.instance[0]).hostname.split(".", 1)[1]
        assert set(args.instance) == replicas[svc], f
        assert args.tokenizer.startswith("/models/")


def test_cluster_files_load_and_give_commands_serve_accepts():
    files = sorted(DEPLOY.glob("cluster*.yaml"))
    cm = next(d for _, d in _objects() if d["kind"] == "ConfigMap")
    docs = [yaml.safe_load(f.read_text()) for f in files]
    docs.append(yaml.safe_load(cm["data"]["cluster.yaml"]))
    assert len(docs) == 3
    for doc in docs:
        spec = spec_from_dict(doc)
        for inst in spec.instances:
            args = build_parser().parse_args(spec.instance_command(inst)[3:])
            assert args.port == inst.port and args.role == inst.role
        router = build_parser().parse_args(spec.router_command()[3:])
        assert router.instance == [i.url for i in spec.instances]
    cm_spec = spec_from_dict(yaml.safe_load(cm["data"]["cluster.yaml"]))
    assert {i.url for i in cm_spec.instances} == _replica_urls()["loomserve"]


def test_llm_d_values_point_at_the_instances():
    values = yaml.safe_load((K8S / "llm-d" / "values.yaml").read_text())
    ext = values["inferenceExtension"]
    epp = yaml.safe_load(ext["pluginsCustomConfig"][ext["pluginsConfigFile"]])
    assert epp["kind"] == "EndpointPickerConfig"
    scorer = next(p for p in epp["plugins"] if p["type"] == "precise-prefix-cache-scorer")
    sts = next(d for f, d in _workloads() if f == "instances.yaml" and d["kind"] == "StatefulSet")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    args, ports = _parse(c), _ports(c)
    ev = scorer["parameters"]["kvEventsConfig"]
    assert ev["discoverPods"] and ev["podDiscoveryConfig"]["socketPort"] == ports["kv-events"]
    assert args.kv_events_topic.startswith(ev["topicFilter"])
    key, value = ev["podDiscoveryConfig"]["podLabelSelector"].split("=")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert labels[key] == value
    assert scorer["parameters"]["tokenProcessorConfig"]["blockSize"] == args.block_size
    pool = values["inferencePool"]
    assert pool["targetPorts"] == [{"number": ports["http"]}]
    assert pool["modelServers"]["matchLabels"].items() <= labels.items()
    refs = {p["pluginRef"] for prof in epp["schedulingProfiles"] for p in prof["plugins"]}
    assert refs <= {p["type"] for p in epp["plugins"]}


@pytest.mark.skipif(not os.path.isfile(DEPLOY / "Dockerfile"), reason="no Dockerfile")
def test_dockerfile_default_command_is_a_serve_command():
    last = [line for line in (DEPLOY / "Dockerfile").read_text().splitlines()
            if line.startswith("CMD")][-1]
    argv = yaml.safe_load(last[3:].strip())
    assert build_parser().parse_args(argv[1:]).port == 8000
