"""`loomserve serve --kv-events-endpoint` as a real subprocess: /info names the bound sockets,
a subscriber built from /info gets the blocks of a request, and the python -m watcher prints
them (also when the core runs in the server's process, --engine-in-process)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from loomserve.control.kv_events import KVEventSubscriber, endpoints_from_info
from loomserve.kv.event_wire import MEDIUM_GPU, BlockStored
from tests.api.server.conftest import TINY_LLAMA
from tests.ports import free_port


@contextlib.contextmanager
def serve(*extra: str):
    if not os.path.isdir(TINY_LLAMA):
        pytest.skip("tests/fixtures/tiny-llama is missing")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "loomserve", "serve", TINY_LLAMA, "--port", str(port),
         "--kv-cache-memory", "4MiB", "--dtype", "float32", "--log-level", "warning",
         "--kv-events-endpoint", "tcp://127.0.0.1:0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def complete(url: str, prompt: str) -> None:
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    assert out.usage.prompt_tokens > 32


PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


def check_subscriber(url: str) -> None:
    """/info names the bound sockets; a subscriber built from it gets a request's blocks."""
    info = httpx.get(url + "/info").json()
    ev = info["kv_events"]
    assert ev["endpoint"].startswith("tcp://127.0.0.1:") and not ev["endpoint"].endswith(":0")
    assert ev["replay_endpoint"].startswith("tcp://127.0.0.1:") and ev["topic"] == ""
    endpoint, replay, topic = endpoints_from_info(info, "127.0.0.1")
    stored: list[BlockStored] = []
    got = threading.Event()

    def on_batch(batch):
        stored.extend(e for e in batch.events if isinstance(e, BlockStored))
        if stored:
            got.set()

    sub = KVEventSubscriber(endpoint, replay, on_batch, lambda: None, topic)
    sub.start()
    try:
        complete(url, PROMPT)
        assert got.wait(20), sub.stats()
        e = stored[0]
        assert (e.medium, e.block_size, e.group_idx) == (MEDIUM_GPU, info["block_size"], 0)
        assert len(e.token_ids) == len(e.block_hashes) * info["block_size"]
        assert sub.stats()["resets"] == 0
    finally:
        sub.close()


def check_watcher(url: str) -> None:
    """python -m loomserve.control.kv_events http://... prints the stream from batch 0."""
    watcher = subprocess.Popen(
        [sys.executable, "-m", "loomserve.control.kv_events", url, "--seconds", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        complete(url, PROMPT + " again")  # whatever the watcher missed comes from the replay
        lines = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = watcher.stdout.readline()
            assert line, watcher.stderr.read()
            lines.append(json.loads(line))
            if any(e["type"] == "BlockStored" for e in lines[-1].get("events", [])):
                break
    finally:
        watcher.terminate()
        watcher.communicate(timeout=10)
    assert lines[0]["seq"] == 0 and lines[0]["events"] == [{"type": "AllBlocksCleared"}]
    e = next(e for ln in lines for e in ln.get("events", []) if e["type"] == "BlockStored")
    assert e["medium"] == "GPU" and all(len(h) == 32 for h in e["block_hashes"])


def test_serve_publishes_and_the_watcher_prints():
    with serve() as url:
        check_subscriber(url)
        check_watcher(url)


def test_serve_in_process_core_publishes():
    with serve("--engine-in-process") as url:
        check_subscriber(url)
