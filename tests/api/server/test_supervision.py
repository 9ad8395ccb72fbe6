"""Supervision: a failure anywhere in the engine core fails every request with a clear error,
never a hang; /health and new requests answer 503; `loomserve serve` exits non-zero.

Faults come from the core's debug hooks (loomserve.engine.faults): LOOMSERVE_FAULT_INJECT
raises on the N-th call of one core-loop path, LOOMSERVE_STEP_DELAY_MS paces the steps so that
requests are surely in flight when the fault hits. Every wait below is bounded (5 s per answer).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.api.server.conftest import TINY_LLAMA, running_server
from tests.ports import free_port

ANSWER_S = 5.0


def long_body(model: str, stream: bool, max_tokens: int = 200) -> dict:
    return {"model": model, "prompt": "tell me a long story", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def stream_until_error(url: str, body: dict, started: threading.Event) -> dict:
    """Read an SSE completion stream; the error it ends with: an in-band error event, or the
    500 body when the core died before the stream's headers went out ({} if none)."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=ANSWER_S * 4) as r:
        if r.status_code == 500:
            return json.loads(r.read())
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if "error" in payload:
                return payload
            started.set()
    return {}


def wait_for(pred, timeout: float) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.02)
    return time.monotonic() - t0


def health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=1).status_code
    except httpx.TransportError:
        return -1


def check_dead(url: str, model: str) -> None:
    assert wait_for(lambda: health(url) == 503, 1.0) <= 1.0
    r = httpx.post(url + "/v1/completions", json=long_body(model, False, 4), timeout=ANSWER_S)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "service_unavailable_error"


# step and tier_poll fire on their 40th call: with 50 ms steps, ~2 s after the first request,
# when both requests are surely in the engine; add fires on the second request's arrival and
# abort when a third client goes away.
@pytest.mark.parametrize("point,in_process", [
    ("step:40", False), ("add:2", False), ("abort:1", False), ("tier_poll:40", False),
    ("step:40", True)])
def test_a_fault_in_the_core_loop_fails_every_in_flight_request(point, in_process):
    config = {"host_cache_memory": "4MiB"} if point.startswith("tier_poll") else {}
    env = {"LOOMSERVE_FAULT_INJECT": point, "LOOMSERVE_STEP_DELAY_MS": "50"}
    with running_server(core_env=env, in_process=in_process, **config) as srv:
        url, results = srv.url, {}
        first_streaming = threading.Event()

        def streamer():
            results["stream"] = stream_until_error(url, long_body(srv.model, True),
                                                   first_streaming)

        def collector():
            results["plain"] = httpx.post(url + "/v1/completions", timeout=ANSWER_S * 4,
                                          json=long_body(srv.model, False))

        threads = [threading.Thread(target=streamer), threading.Thread(target=collector)]
        threads[0].start()
        if not point.startswith("add"):
            first_streaming.wait(ANSWER_S)  # running when the fault hits (add:2 hits before)
        threads[1].start()
        if not point.startswith("add"):
            stats = srv.engine.stats
            wait_for(lambda: stats().num_running + stats().num_waiting >= 2, ANSWER_S)
        if point.startswith("abort"):  # the abort path runs when a client goes away
            first_streaming.wait(ANSWER_S)
            with httpx.stream("POST", url + "/v1/completions", timeout=ANSWER_S,
                              json=long_body(srv.model, True)) as r:
                next(r.iter_lines())
        t0 = time.monotonic()
        for t in threads:
            t.join(timeout=ANSWER_S * 3)
            assert not t.is_alive(), "a request hung after the core failed"
        assert time.monotonic() - t0 < ANSWER_S * 3
        plain = results["plain"]
        assert plain.status_code == 500, plain.text
        assert plain.json()["error"]["code"] == "engine_core_failed"
        assert "injected fault" in plain.json()["error"]["message"]
        assert results["stream"].get("error", {}).get("type") == "internal_server_error"
        check_dead(url, srv.model)


def test_a_fault_in_idle_work_makes_the_server_unavailable():
    with running_server(core_env={"LOOMSERVE_FAULT_INJECT": "idle:3"}) as srv:
        wait_for(lambda: not srv.engine.is_healthy, ANSWER_S)
        check_dead(srv.url, srv.model)



def launch_serve(port: int, env: dict, *extra: str) -> subprocess.Popen:
    """`python -m loomserve serve` on the tiny model, not yet waited for."""
    return subprocess.Popen(
        [sys.executable, "-m", "loomserve", "serve", TINY_LLAMA, "--port", str(port),
         "--kv-cache-memory", "8MiB", "--log-level", "warning", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env})


def wait_serving(proc: subprocess.Popen, port: int) -> int:
    """The engine core's pid once a launched serve is healthy."""
    line = proc.stdout.readline()
    match = re.search(r"engine core pid (\d+)", line)
    assert match, line + proc.stdout.read() if proc.poll() is not None else line
    wait_for(lambda: health(f"http://127.0.0.1:{port}") == 200, 30)
    return int(match.group(1))


# The three `serve` processes below boot together (one boot is mostly one core's work: two
# overlap on this 2-core CI host); each test then owns, and ends, its own.
SERVE_ENVS = {"core_kill": {"LOOMSERVE_STEP_DELAY_MS": "20"},
              "step_fault": {"LOOMSERVE_FAULT_INJECT": "step:2"},
              "front_kill": {"LOOMSERVE_STEP_DELAY_MS": "3000"}}


@pytest.fixture(scope="module")
def serves():
    """name -> (process, port), launched at once; a test waits for its own with wait_serving."""
    launched = {}
    try:
        for name, env in SERVE_ENVS.items():
            port = free_port()
            launched[name] = (launch_serve(port, env), port)
        yield launched
    finally:
        for proc, _ in launched.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()


def test_sigkill_of_the_core_mid_stream_fails_requests_and_exits_nonzero(serves):
    proc, port = serves["core_kill"]
    url = f"http://127.0.0.1:{port}"
    core_pid = wait_serving(proc, port)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        started, result = threading.Event(), {}
        reader = threading.Thread(target=lambda: result.update(
            stream_until_error(url, long_body(model, True, 200), started)))
        reader.start()
        assert started.wait(ANSWER_S), "the stream never started"
        os.kill(core_pid, signal.SIGKILL)
        killed = time.monotonic()
        reader.join(timeout=ANSWER_S)
        assert not reader.is_alive(), "the stream hung after the core was killed"
        assert result["error"]["code"] == "engine_core_failed"
        assert "exited with code -9" in result["error"]["message"]
        assert wait_for(lambda: health(url) == 503, 1.0) <= 1.0
        assert time.monotonic() - killed < ANSWER_S
        assert proc.wait(timeout=ANSWER_S * 2) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_injected_step_fault_makes_serve_exit_nonzero_with_the_traceback_logged(serves):
    proc, port = serves["step_fault"]
    wait_serving(proc, port)
    try:
        url = f"http://127.0.0.1:{port}"
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        r = httpx.post(url + "/v1/completions", json=long_body(model, False, 8),
                       timeout=ANSWER_S)
        assert r.status_code == 500 and "injected fault in step" in r.json()["error"]["message"]
        assert proc.wait(timeout=ANSWER_S * 2) == 1
        out = proc.stdout.read()
        assert "Traceback" in out and "InjectedFault" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_sigkill_of_the_front_end_mid_step_takes_the_core_with_it(serves):
    """The core must never outlive its front end, even inside a long step (where the loop's
    own parent check cannot run): the kernel kills it (PR_SET_PDEATHSIG)."""
    proc, port = serves["front_kill"]
    wait_serving(proc, port)
    try:
        url = f"http://127.0.0.1:{port}"
        info = httpx.get(url + "/info").json()
        core_pid = info["pid"]
        assert core_pid != proc.pid
        model = info["model"]
        with httpx.Client(timeout=ANSWER_S) as c:
            with c.stream("POST", url + "/v1/completions", json=long_body(model, True, 8)):
                time.sleep(0.5)  # the core is now inside its 3 s step delay
                proc.kill()
        proc.wait(timeout=ANSWER_S)
        deadline = time.monotonic() + 2.0  # well inside the 3 s step
        while time.monotonic() < deadline and _alive(core_pid):
            time.sleep(0.05)
        assert not _alive(core_pid), "the engine core outlived its killed front end"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
