"""`loomserve router` in front of two real `loomserve serve` instances (tiny-llama, KV events
on), all as subprocesses, driven through the official openai and anthropic clients. The last
test SIGKILLs one instance: it must leave the router's set within two seconds, its in-flight
stream must end with an error (not hang), and its session must go on elsewhere."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.ports import free_port

TINY_LLAMA = os.path.abspath(os.path.join(os.path.dirname(__file__), "../fixtures/tiny-llama"))
START_TIMEOUT_S = 300  # engines start slowly on a shared 2-core host
SYSTEM = ("You are the archivist of a weaving museum. Answer every question about looms, "
          "shuttles, warps and wefts with care, citing the catalogue number of each object "
          "you mention, and keep a calm and friendly tone throughout the conversation.")



@dataclass
class Proc:
    url: str
    proc: subprocess.Popen
    log: str

    @property
    def name(self) -> str:
        return self.url.split("://", 1)[1]

    def kill(self, sig=signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the server and its engine core process
        except ProcessLookupError:
            pass


def spawn(args: list[str], log: str, env: dict | None = None) -> subprocess.Popen:
    out = open(log, "wb")
    try:
        return subprocess.Popen([sys.executable, "-m", "loomserve", *args], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=None if env is None else {**os.environ, **env})
    finally:
        out.close()


def wait_for(cond, timeout: float, what: str, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.proc.poll() is not None:
                raise AssertionError(f"{p.name} exited: {open(p.log).read()[-2000:]}")
        try:
            if cond():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


# Instances pace their steps (5 ms each), so a 200-token request is still running 0.3 s after
# it starts whatever the scheduler's step timing: the SIGKILL test needs requests in flight.
PACED = {"LOOMSERVE_STEP_DELAY_MS": "5"}


@dataclass
class Cluster:
    router: str
    instances: list[Proc]

    def health(self) -> dict:
        return httpx.get(self.router + "/health", timeout=5).json()

    def row(self, name: str) -> dict:
        return next(r for r in self.health()["instances"] if r["instance"] == name)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not os.path.isdir(TINY_LLAMA):
        pytest.skip("tests/fixtures/tiny-llama is missing")
    logs = tmp_path_factory.mktemp("router")
    procs: list[Proc] = []
    try:
        for i in range(2):
            port = free_port()
            log = str(logs / f"instance{i}.log")
            procs.append(Proc(f"http://127.0.0.1:{port}", spawn(
                ["serve", TINY_LLAMA, "--port", str(port), "--dtype", "float32",
                 "--kv-cache-memory", "8MiB", "--kv-events-endpoint", "tcp://127.0.0.1:0",
                 "--log-level", "warning"], log, PACED), log))
        port = free_port()
        log = str(logs / "router.log")
        args = ["router", "--port", str(port), "--log-level", "warning"]
        for p in procs:
            args += ["--instance", p.url]
        router = Proc(f"http://127.0.0.1:{port}", spawn(args, log), log)
        c = Cluster(router.url, procs)

        def ready():
            h = c.health()
            return h["tokenizer"] and all(r["up"] for r in h["instances"])
        wait_for(ready, START_TIMEOUT_S, "instances up behind the router", procs + [router])
        yield c
    finally:
        for p in procs + ([router] if "router" in locals() else []):
            p.kill(signal.SIGTERM)
        for p in procs + ([router] if "router" in locals() else []):
            try:
                p.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.proc.wait(timeout=5)


def chat(c: Cluster, session: str | None, messages: list[dict], max_tokens: int = 4,
         **extra) -> httpx.Response:
    headers = {"x-session-id": session} if session else {}
    r = httpx.post(c.router + "/v1/chat/completions", headers=headers, timeout=60, json={
        "model": "tiny-llama", "messages": messages, "max_tokens": max_tokens, **extra})
    assert r.status_code == 200, r.text
    return r


def test_openai_apis_stream_and_not(cluster):
    import openai
    client = openai.OpenAI(base_url=cluster.router + "/v1", api_key="none", max_retries=0,
                           timeout=60)
    msgs = [{"role": "user", "content": "Hello loom"}]
    out = client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=5)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=msgs,
                                                 max_tokens=5, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    comp = client.completions.create(model="tiny-llama", prompt="The loom", max_tokens=4)
    assert comp.usage.completion_tokens == 4
    parts = list(client.completions.create(model="tiny-llama", prompt="The loom", max_tokens=4,
                                           stream=True))
    assert parts[-1].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list()] == ["tiny-llama"]
    assert client.models.retrieve("tiny-llama").id == "tiny-llama"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with pytest.raises(openai.BadRequestError):  # the instance's 400 passes through as is
        client.chat.completions.create(model="tiny-llama", messages=[], max_tokens=2)


def test_anthropic_messages_and_responses_continuation(cluster):
    import anthropic
    import openai
    a = anthropic.Anthropic(base_url=cluster.router, api_key="none", max_retries=0, timeout=60)
    msg = a.messages.create(model="tiny-llama", max_tokens=4,
                            messages=[{"role": "user", "content": "Hi"}])
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 4
    with a.messages.stream(model="tiny-llama", max_tokens=4,
                           messages=[{"role": "user", "content": "Hi"}]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens"
    o = openai.OpenAI(base_url=cluster.router + "/v1", api_key="none", max_retries=0,
                      timeout=60)
    first = o.responses.with_raw_response.create(model="tiny-llama", input="Hi",
                                                 max_output_tokens=4)
    resp = first.parse()
    assert resp.status == "incomplete" and resp.usage.output_tokens == 4
    home = first.headers["x-loomserve-instance"]
    for _ in range(3):  # the stored history lives on one instance: continuations go there
        nxt = o.responses.with_raw_response.create(
            model="tiny-llama", input="More", previous_response_id=resp.id, max_output_tokens=3)
        assert nxt.headers["x-loomserve-instance"] == home
        assert nxt.headers["x-loomserve-route"] == "stickiness"
    events = list(o.responses.create(model="tiny-llama", input="Hi", max_output_tokens=3,
                                     stream=True))
    assert events[-1].type == "response.incomplete"


def test_sessions_stick_and_new_sessions_follow_their_prefix(cluster):
    homes = {}
    for k in range(2):
        prefix = [{"role": "system", "content": f"{SYSTEM} Archive wing {k}."},
                  {"role": "user", "content": "What is a dobby loom?"}]
        r = chat(cluster, f"owner-{k}", prefix)
        home = homes[k] = r.headers["x-loomserve-instance"]
        for turn in range(2):
            r = chat(cluster, f"owner-{k}", prefix + [
                {"role": "assistant", "content": "A loom."},
                {"role": "user", "content": f"Turn {turn}?"}])
            assert r.headers["x-loomserve-instance"] == home
            assert r.headers["x-loomserve-route"] == "stickiness"
        # after the instance's KV events reached the router's index
        wait_for(lambda: cluster.row(home)["cached_blocks"] >= 6, 30, "KV events")
    for k in range(2):
        prefix = [{"role": "system", "content": f"{SYSTEM} Archive wing {k}."},
                  {"role": "user", "content": "What is a dobby loom?"}]
        r = chat(cluster, f"newcomer-{k}", prefix)
        assert r.headers["x-loomserve-instance"] == homes[k]
        reason, overlap = r.headers["x-loomserve-route"].split("; overlap=")
        assert reason == "overlap" and int(overlap) >= 6
    # an ended session is forgotten: its next request is placed again, not sticky
    r = httpx.delete(cluster.router + "/v1/sessions/newcomer-0", timeout=10)
    assert r.status_code == 200 and r.json()["deleted"] is True
    prefix = [{"role": "system", "content": f"{SYSTEM} Archive wing 0."},
              {"role": "user", "content": "What is a dobby loom?"}]
    assert chat(cluster, "newcomer-0", prefix).headers["x-loomserve-route"].startswith("overlap")


def test_metrics_say_why(cluster):
    text = httpx.get(cluster.router + "/metrics", timeout=5).text
    for reason in ("stickiness", "overlap"):
        assert f'reason="{reason}"' in text
    for p in cluster.instances:
        assert f'loomserve_router_instance_up{{instance="{p.name}",role="both"}} 1.0' in text
    assert "loomserve_router_overlap_blocks_count" in text
    # the instances' miss causes, counted by the router (the earlier tests' requests)
    first = re.search(r'loomserve_prefix_cache_miss_tokens_total\{cause="first_sight"\} (\S+)',
                      text)
    assert first and float(first.group(1)) > 0


def test_router_api_key_in_each_api_shape(cluster):
    from fastapi.testclient import TestClient

    from loomserve.cli import build_parser
    from loomserve.control.router.cli import build_from_args
    args = build_parser().parse_args(["router", "--api-key", "sekret", "--log-level", "warning"]
                                     + [a for p in cluster.instances for a in ("--instance",
                                                                                p.url)])
    with TestClient(build_from_args(args)) as c:
        deadline = time.monotonic() + 60  # open, like the instances'; 200 once ready
        while (h := c.get("/health")).status_code != 200:
            assert h.status_code == 503 and time.monotonic() < deadline, h.text
            time.sleep(0.1)
        r = c.post("/v1/chat/completions", json={"model": "tiny-llama", "messages": []})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = c.post("/v1/messages", json={})
        assert r.status_code == 401 and r.json()["type"] == "error"
        r = c.post("/v1/completions", headers={"Authorization": "Bearer sekret"},
                   json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def _fake_instance():
    """An HTTP server that passes for an instance (/health, /info) until it is stopped."""
    import uvicorn
    from fastapi import FastAPI
    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    app.get("/info")(lambda: {"role": "both", "block_size": 16, "model_folder": TINY_LLAMA,
                              "kv_events": None})
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    wait_for(lambda: srv.started, 30, "the fake instance")
    return f"http://127.0.0.1:{port}", srv, thread


def test_unreachable_choice_is_retried_on_the_next(cluster):
    from fastapi.testclient import TestClient

    from loomserve.cli import build_parser
    from loomserve.control.router.cli import build_from_args
    fake_url, srv, thread = _fake_instance()
    args = build_parser().parse_args([
        "router", "--policy", "round_robin", "--health-interval", "60", "--instance", fake_url,
        "--instance", cluster.instances[0].url])
    with TestClient(build_from_args(args)) as c:
        assert all(r["up"] for r in c.get("/health").json()["instances"])
        srv.should_exit = True  # gone, and the health checker will not notice for a minute
        thread.join(timeout=10)
        for _ in range(2):  # round robin: one of the two picks the dead one first
            r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": "Hi",
                                                "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.headers["x-loomserve-instance"] == cluster.instances[0].name
        assert 'loomserve_router_errors_total{kind="connect"} 1.0' in c.get("/metrics").text
        assert not c.get("/health").json()["instances"][0]["up"]


def test_client_gone_mid_stream_releases_the_load(cluster):
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Long tale"}],
            "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.router + "/v1/chat/completions", json=body, timeout=60,
                      headers={"x-session-id": "leaver"}) as r:
        home = r.headers["x-loomserve-instance"]
        next(r.iter_bytes())  # then leave (the stream may be done already: tiny model)
    wait_for(lambda: cluster.row(home)["active_requests"] == 0
             and cluster.row(home)["active_blocks"] == 0, 10, "the lease released")


def test_hung_instance_fails_its_stream_then_comes_back(cluster):
    """SIGSTOP (a hang, not a death): out after two timed-out health checks, the stream in
    flight ends with an error event instead of waiting on the silent socket; SIGCONT: back."""
    import openai
    prefix = [{"role": "user", "content": "A long story about a shuttle, please."}]
    name = chat(cluster, "frozen", prefix).headers["x-loomserve-instance"]
    victim = next(p for p in cluster.instances if p.name == name)
    client = openai.OpenAI(base_url=cluster.router + "/v1", api_key="none", max_retries=0,
                           timeout=60, default_headers={"x-session-id": "frozen"})
    it = iter(client.chat.completions.create(model="tiny-llama", messages=prefix,
                                             max_tokens=200, stream=True,
                                             extra_body={"ignore_eos": True}))
    next(it)
    victim.kill(signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        wait_for(lambda: not cluster.row(name)["up"], 10, "the hung instance marked down")
        assert time.monotonic() - stopped < 3.0  # 2 x (interval + timeout) + polling slack
        chunks, error = 0, None
        try:
            for _ in it:
                chunks += 1
        except openai.APIError as e:
            error = e
        assert error is not None or chunks >= 150  # (had it finished before the stop)
    finally:
        victim.kill(signal.SIGCONT)
    wait_for(lambda: cluster.row(name)["up"], 15, "the instance back up")
    assert chat(cluster, None, prefix).status_code == 200


def test_sigkill_instance_out_within_two_seconds(cluster):
    import openai
    prefix = [{"role": "user", "content": "Tell me a very long story about a loom."}]
    victim_name = chat(cluster, "doomed", prefix).headers["x-loomserve-instance"]
    victim = next(p for p in cluster.instances if p.name == victim_name)
    client = openai.OpenAI(base_url=cluster.router + "/v1", api_key="none", max_retries=0,
                           timeout=60, default_headers={"x-session-id": "doomed"})
    stream = client.chat.completions.create(
        model="tiny-llama", messages=prefix, max_tokens=200, stream=True,
        extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)  # the stream is running on the victim
    outcome: dict = {}

    def drain():
        try:
            for chunk in it:
                outcome["chunks"] = outcome.get("chunks", 0) + 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    outcome["finish"] = chunk.choices[0].finish_reason
        except openai.APIError as e:
            outcome["error"] = e
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    plain: dict = {}  # non-streamed requests in flight on the victim: a 502 in the API's shape

    def post(path: str, body: dict) -> None:
        plain[path] = httpx.post(cluster.router + path, json=body, timeout=60,
                                 headers={"x-session-id": "doomed"})
    posts = [threading.Thread(target=post, args=a, daemon=True) for a in (
        ("/v1/chat/completions", {"model": "tiny-llama", "messages": prefix,
                                  "max_tokens": 200, "ignore_eos": True}),
        ("/v1/messages", {"model": "tiny-llama", "messages": prefix, "max_tokens": 200,
                          "ignore_eos": True}))]
    for t in posts:
        t.start()

    def in_flight() -> float:  # the victim's running and waiting requests
        text = httpx.get(victim.url + "/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(
            ("loomserve_num_requests_running{", "loomserve_num_requests_waiting{")))
    # Both posts on the victim (and the stream, unless it already ended) before the kill: a
    # fixed sleep let a loaded host send them only after it, to the other instance.
    wait_for(lambda: in_flight() >= 2 + ("finish" not in outcome), 30, "requests on the victim")
    victim.kill()
    killed = time.monotonic()
    wait_for(lambda: not cluster.row(victim_name)["up"], 5, "the victim marked down")
    assert time.monotonic() - killed < 2.0
    reader.join(timeout=30)
    assert not reader.is_alive(), "the in-flight stream hung"
    # either the stream had already finished before the kill (all 200 tokens), or it ended
    # with an error event: never cut short silently
    assert "error" in outcome or outcome.get("finish") == "length", outcome
    if "error" in outcome:
        assert "failed mid-stream" in str(outcome["error"])
    for t in posts:
        t.join(timeout=30)
        assert not t.is_alive(), "a non-streamed request hung"
    chat_r, msg_r = plain["/v1/chat/completions"], plain["/v1/messages"]
    assert chat_r.status_code in (200, 502), chat_r.text
    if chat_r.status_code == 502:
        assert chat_r.json()["error"]["code"] == "instance_failed"
    assert msg_r.status_code in (200, 502), msg_r.text
    if msg_r.status_code == 502:
        assert msg_r.json()["type"] == "error" and msg_r.json()["error"]["type"] == "api_error"
    assert 502 in (chat_r.status_code, msg_r.status_code)
    r = chat(cluster, "doomed", prefix + [{"role": "assistant", "content": "Once"},
                                         {"role": "user", "content": "Go on"}])
    survivor = r.headers["x-loomserve-instance"]
    assert survivor != victim_name
    # re-placed by this request, or already by a request above that arrived after the kill
    assert r.headers["x-loomserve-route"].split(";")[0] in ("fallback", "stickiness")
    metrics = httpx.get(cluster.router + "/metrics", timeout=5).text
    assert f'requests_total{{instance="{survivor}",reason="fallback"}}' in metrics
    assert chat(cluster, "doomed", prefix).headers["x-loomserve-route"] == "stickiness"
    assert cluster.health()["status"] == "ok"
