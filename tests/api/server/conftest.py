"""One real engine on the tiny fixture model behind a real uvicorn server, for the whole session.

The engine core runs in its own process, as `loomserve serve` runs it; uvicorn runs in a thread
of the test process, so tests can read engine.stats() (the core's latest snapshot) directly.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass

import pytest

TINY_LLAMA = os.environ.get("LOOMSERVE_TEST_MODEL") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "tiny-llama"))
# tiny-llama's weights with a Hermes tool-calling template and a 4096-token context
TINY_AGENT = os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "tiny-agent"))


@dataclass
class RunningServer:
    url: str
    engine: object

    @property
    def model(self) -> str:
        return self.engine.model_name

    def wait_idle(self, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.engine.stats()
            if s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_used == 0:
                return s
            time.sleep(0.02)
        raise AssertionError(f"engine not idle after {timeout}s: {self.engine.stats()}")


@contextlib.contextmanager
def running_server(*, in_process: bool = False, core_env: dict | None = None,
                   api_keys: list[str] | None = None, app_options: dict | None = None,
                   **config):
    """A real engine (tiny fixture model unless config says otherwise) behind uvicorn.
    core_env: environment variables the engine core starts with (its debug hooks);
    app_options: build_app's keyword options (served_model_names, chat_template, parsers)."""
    if not os.path.isdir(TINY_LLAMA):
        pytest.skip("tests/fixtures/tiny-llama is missing")
    from loomserve.config import EngineConfig
    from loomserve.engine.async_llm import AsyncLLM

    config = {"model": TINY_LLAMA, "kv_cache_memory": "8MiB", "dtype": "float32", **config}
    with _environ(core_env or {}):
        engine = AsyncLLM(EngineConfig.from_kwargs(**config), in_process=in_process)
    try:
        with app_over(engine, api_keys, app_options) as srv:
            yield srv
    finally:
        engine.shutdown()


@contextlib.contextmanager
def app_over(engine, api_keys: list[str] | None = None, app_options: dict | None = None):
    """build_app over an engine that is already running (a session one: an engine start costs
    seconds, an app none), behind its own uvicorn; the engine outlives the app."""
    import uvicorn

    from loomserve.api.app import build_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = build_app(engine, api_keys, **(app_options or {}))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", engine)
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextlib.contextmanager
def _environ(values: dict):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def server():
    with running_server() as srv:
        yield srv


@pytest.fixture(scope="session")
def keyed_server(server):
    """The session engine behind an app that wants the API key "sekrit"."""
    with app_over(server.engine, ["sekrit"]) as srv:
        yield srv


@pytest.fixture(scope="session")
def agent_server():
    """The tool-calling fixture (tiny-agent) behind a server, for the whole session."""
    if not os.path.isdir(TINY_AGENT):
        pytest.skip("tests/fixtures/tiny-agent is missing")
    with running_server(model=TINY_AGENT, kv_cache_memory="16MiB") as srv:
        yield srv


@pytest.fixture(scope="session")
def agent_client(agent_server):
    import openai
    return openai.OpenAI(base_url=agent_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="session")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def aclient_factory(server):
    import openai
    # AsyncOpenAI binds to the event loop it first runs on: build one per asyncio.run.
    return lambda: openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=60)
