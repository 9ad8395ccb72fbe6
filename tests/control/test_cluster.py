"""`loomserve cluster`: commands from a YAML file (dry run), spec errors, and a real cluster of
two tiny-llama instances (plus the router once loomserve.control.router.cli exists): both
healthy, a killed instance restarted, a clean stop that leaves no process behind."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from loomserve.cli import build_parser, main
from loomserve.control.cluster.spec import SpecError, spec_from_dict

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TINY_LLAMA = os.path.join(ROOT, "tests", "fixtures", "tiny-llama")
HAVE_ROUTER = importlib.util.find_spec("loomserve.control.router.cli") is not None

PD_FILE = {
    "model": "/models/m",
    "serve_args": ["--dtype", "float32"],
    "instances": [
        {"name": "p0", "host": "10.0.0.1", "bind": "0.0.0.0", "port": 8000, "role": "prefill",
         "node": "a"},
        {"name": "d0", "host": "10.0.0.2", "port": 8000, "role": "decode", "node": "b",
         "args": "--kv-cache-memory 2GiB"},
        {"name": "d1", "host": "10.0.0.2", "port": 8001, "role": "decode", "node": "b",
         "kv_events_port": 6000},
    ],
    "router": {"host": "10.0.0.1", "port": 9000, "policy": "kv_aware", "node": "a"},
}


def _dry_run(tmp_path, capsys, *argv) -> list[list[str]]:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(PD_FILE))
    assert main(["cluster", "--config", str(path), "--dry-run", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    return [shlex.split(line) for line in lines if not line.startswith("#")]


def test_dry_run_node_a_starts_its_prefill_instance_and_the_router(tmp_path, capsys):
    serve, router = _dry_run(tmp_path, capsys, "--node", "a", "--", "--seed", "7")
    assert serve[1:4] == ["-m", "loomserve", "serve"]
    args = build_parser().parse_args(serve[3:])  # every flag is one `loomserve serve` has
    assert (args.model, args.host, args.port, args.role) == ("/models/m", "0.0.0.0", 8000,
                                                             "prefill")
    assert args.kv_events_endpoint == "tcp://*:5557" and args.kv_transfer_host == "10.0.0.1"
    assert args.dtype == "float32" and args.seed == 7
    assert router[3] == "router"
    urls = [router[i + 1] for i, a in enumerate(router) if a == "--instance"]
    assert urls == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.2:8001"]
    assert router[router.index("--policy") + 1] == "kv_aware"


def test_dry_run_node_b_starts_two_decode_instances_and_no_router(tmp_path, capsys):
    cmds = _dry_run(tmp_path, capsys, "--node", "b")
    assert len(cmds) == 2 and all(c[3] == "serve" for c in cmds)
    a0, a1 = (build_parser().parse_args(c[3:]) for c in cmds)
    assert (a0.role, a0.port, a0.kv_cache_memory) == ("decode", 8000, "2GiB")
    assert a0.kv_events_endpoint == "tcp://10.0.0.2:5559"  # base 5557 + 2 x index 1
    assert a1.kv_events_endpoint == "tcp://10.0.0.2:6000"


def test_flags_mode_lays_out_prefill_then_decode(capsys):
    assert main(["cluster", "--prefill", "1", "--decode", "2", "--base-port", "8200",
                 "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# prefill-0" in out and "# decode-1" in out
    assert "--port 8202 --role decode --kv-events-endpoint tcp://127.0.0.1:5561" in out
    assert "--instance http://127.0.0.1:8200 --instance http://127.0.0.1:8201" in out


@pytest.mark.parametrize("change, message", [
    (lambda d: d["instances"][1].update(host="10.0.0.1"), "port 8000 on 10.0.0.1 is used twice"),
    (lambda d: d["instances"][2].update(kv_events_port=8000), "used twice"),
    (lambda d: d["instances"][0].update(role="mixed"), "instances[0].role"),
    (lambda d: d["instances"][0].update(colour="red"), "unknown key(s) colour"),
    (lambda d: d["instances"][0].pop("port"), "instances[0].port: missing"),
    (lambda d: d.update(instances=[]), "non-empty list"),
    (lambda d: d["router"].update(port="x"), "router.port"),
])
def test_bad_cluster_files_are_refused_with_the_key_named(change, message):
    doc = json.loads(json.dumps(PD_FILE))
    change(doc)
    with pytest.raises(SpecError, match=re.escape(message)):
        spec_from_dict(doc)


def test_unknown_node_and_bad_file_exit_2(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(PD_FILE))
    assert main(["cluster", "--config", str(path), "--node", "zz", "--dry-run"]) == 2
    assert "--node 'zz' is not in the file (nodes: a, b)" in capsys.readouterr().err
    path.write_text("instances: [")
    assert main(["cluster", "--config", str(path), "--dry-run"]) == 2
    assert "not valid YAML" in capsys.readouterr().err


# -- a real cluster ----------------------------------------------------------------------------
def _free_pair() -> int:
    """A port p with p + 1 free too (KV events and their replay)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the cluster exited with {proc.returncode}")
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.2)


def _state(log_dir):
    try:
        return json.loads((log_dir / "cluster.json").read_text())
    except (OSError, ValueError):
        return None


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _start(tmp_path, doc: dict, *flags: str) -> tuple[subprocess.Popen, object]:
    cfg, log_dir = tmp_path / "cluster.yaml", tmp_path / "logs"
    cfg.write_text(yaml.safe_dump(doc))
    out = open(tmp_path / "cluster.out", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "loomserve", "cluster", "--config", str(cfg),
                             "--log-dir", str(log_dir), *flags], stdout=out,
                            stderr=subprocess.STDOUT, cwd=ROOT)
    return proc, log_dir


def _tiny_doc(n: int) -> dict:
    ports = [_free_pair() for _ in range(2 * n + 1)]
    return {"model": TINY_LLAMA,
            "serve_args": ["--dtype", "float32", "--kv-cache-memory", "8MiB",
                           "--log-level", "warning"],
            "instances": [{"name": f"i{k}", "port": ports[2 * k],
                           "kv_events_port": ports[2 * k + 1]} for k in range(n)],
            "router": {"port": ports[-1], "policy": "round_robin"} if HAVE_ROUTER else None}


@pytest.mark.skipif(not os.path.isdir(TINY_LLAMA), reason="tests/fixtures/tiny-llama is missing")
def test_real_cluster_starts_restarts_and_stops_clean(tmp_path):
    doc = _tiny_doc(2)
    proc, log_dir = _start(tmp_path, doc, "--restart")
    pgids = []
    try:
        state = _wait(lambda: _state(log_dir), 180, "cluster ready", proc)
        urls = [f"http://127.0.0.1:{i['port']}" for i in doc["instances"]]
        assert all(_healthy(u) for u in urls)
        infos = [httpx.get(u + "/info", timeout=5).json() for u in urls]
        assert [i["role"] for i in infos] == ["both", "both"]
        events_port = doc["instances"][1]["kv_events_port"]
        assert infos[1]["kv_events"]["endpoint"].endswith(f":{events_port}")
        pgids = [state[n]["pid"] for n in state]
        if HAVE_ROUTER:
            import openai
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{doc['router']['port']}/v1",
                                   api_key="unused", max_retries=0, timeout=60)
            done = client.completions.create(model=infos[0]["model"], prompt="Hello",
                                              max_tokens=4)
            assert done.usage.completion_tokens == 4
        # an instance that dies is restarted (--restart) and becomes healthy again
        os.killpg(state["i0"]["pid"], signal.SIGKILL)
        _wait(lambda: (_state(log_dir) or {}).get("i0", {}).get("restarts") == 1, 30,
              "restart", proc)
        pgids.append(_state(log_dir)["i0"]["pid"])
        _wait(lambda: _healthy(urls[0]), 120, "restarted instance healthy", proc)
        if HAVE_ROUTER:  # the router dying ends the cluster with an error, instances stopped
            os.killpg(state["router"]["pid"], signal.SIGKILL)
            rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    out = (tmp_path / "cluster.out").read_text()
    assert rc == (1 if HAVE_ROUTER else 0), out
    assert "i0 (pid" in out and "restarting i0" in out and "loomserve cluster: stopped" in out
    assert not HAVE_ROUTER or "the router exited" in out
    assert pgids and not any(_group_alive(p) for p in pgids)  # servers and their engine cores


@pytest.mark.skipif(not os.path.isdir(TINY_LLAMA), reason="tests/fixtures/tiny-llama is missing")
def test_an_instance_that_cannot_start_fails_the_cluster_with_its_log(tmp_path):
    doc = _tiny_doc(2)
    doc["instances"][1]["model"] = str(tmp_path / "no-such-model")
    proc, log_dir = _start(tmp_path, doc)
    rc = proc.wait(120)
    out = (tmp_path / "cluster.out").read_text()
    assert rc == 1 and "i1 exited with" in out and "no-such-model" in out
    assert _state(log_dir) is None  # never got ready
    assert not _healthy(f"http://127.0.0.1:{doc['instances'][0]['port']}")  # i0 was stopped


@pytest.mark.skipif(not (HAVE_ROUTER and os.path.isdir(TINY_LLAMA)),
                    reason="needs loomserve.control.router and tests/fixtures/tiny-llama")
def test_pd_cluster_from_a_file_disaggregates_a_long_prompt(tmp_path):
    """1 prefill + 1 decode instance and the router from one cluster file: a long cold prompt
    is prefilled on the prefill instance and answered by the decode one from the imported KV
    (the roles and --kv-transfer-host the file gives reach the instances)."""
    pytest.importorskip("mooncake.engine")
    doc = _tiny_doc(2)
    doc["serve_args"] += ["--kv-transfer-backend", "mooncake", "--kv-transfer-timeout", "5"]
    doc["instances"][0].update(name="prefill-0", role="prefill")
    doc["instances"][1].update(name="decode-0", role="decode")
    doc["router"].update(policy="default", args=["--pd-threshold-tokens", "48"])
    proc, log_dir = _start(tmp_path, doc)
    pgids = []
    try:
        pgids = [c["pid"] for c in _wait(lambda: _state(log_dir), 180, "cluster ready",
                                         proc).values()]
        router = f"http://127.0.0.1:{doc['router']['port']}"

        def router_ready():  # its tokenizer loaded (it counts uncached tokens) and both up
            h = httpx.get(router + "/health", timeout=5).json()
            return h.get("tokenizer") and all(r["up"] for r in h["instances"])
        _wait(router_ready, 60, "router ready", proc)
        prompt = "Tell me about the quick brown fox that jumps over the lazy dog. " * 6
        r = httpx.post(router + "/v1/chat/completions", timeout=60, json={
            "model": "tiny-llama", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        ports = {i["name"]: str(i["port"]) for i in doc["instances"]}
        assert r.headers["x-loomserve-instance"].endswith(ports["decode-0"])
        assert r.headers["x-loomserve-prefill"].endswith(ports["prefill-0"])
        # the client's usage is what the prompt cost (its prefill leg computed it cold); the
        # decode instance's own counters show the prompt arrived from its peer, not computed
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        metrics = httpx.get(f"http://127.0.0.1:{ports['decode-0']}/metrics", timeout=5).text
        peer = [float(m.group(1)) for m in re.finditer(
            r'^loomserve_prefix_cache_hit_tokens_by_source_total\{[^}]*source="peer"[^}]*\} (\S+)',
            metrics, re.M)]
        assert peer and peer[0] > 48, metrics[-2000:]  # imported
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert len(pgids) == 3 and not any(_group_alive(p) for p in pgids)
