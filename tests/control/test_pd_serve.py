"""Prefill/decode disaggregation between real `loomserve serve` processes (Mooncake Transfer
Engine over TCP), the handshake driven by hand with the official clients: the prefill leg
(max tokens 1, kv_transfer_params {"do_remote_decode": true}) returns kv_transfer_params; the
decode leg with them answers exactly as a single instance, from the imported prefix. A prefill
instance killed between the legs costs a recompute, not an error or a hang."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.api.server.conftest import TINY_LLAMA
from tests.ports import free_port

pytest.importorskip("mooncake.engine")

TIMEOUT = 5.0  # --kv-transfer-timeout
PROMPT = "Tell me about the quick brown fox that jumps over the lazy dog. " * 6
DO_REMOTE = {"do_remote_decode": True}


@contextlib.contextmanager
def serve(*roles: str):
    """One server per role, started together; yields [(url, process)] once all are up."""
    if not os.path.isdir(TINY_LLAMA):
        pytest.skip("tests/fixtures/tiny-llama is missing")
    procs = []
    try:
        for role in roles:
            port = free_port()
            procs.append((f"http://127.0.0.1:{port}", subprocess.Popen(
                [sys.executable, "-m", "loomserve", "serve", TINY_LLAMA, "--port", str(port),
                 "--kv-cache-memory", "4MiB", "--dtype", "float32", "--log-level", "warning",
                 "--role", role, "--kv-transfer-backend", "mooncake",
                 "--kv-transfer-timeout", str(TIMEOUT)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        deadline = time.monotonic() + 300  # three engines booting at once on a busy host
        for url, proc in procs:
            while True:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "server did not come up"
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
        yield procs
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for _, proc in procs:
            try:
                proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def openai_client(url: str):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def cluster():
    """prefill, decode, single; the last test of this module kills the prefill instance (a
    fourth server just for that costs an engine boot, ~15 s of this 2-core CI host)."""
    with serve("prefill", "decode", "both") as procs:
        yield procs


@pytest.fixture
def pds(cluster):
    """The prefill, decode and single instance's URLs."""
    return [url for url, _ in cluster[:3]]


def chat(url: str, max_tokens: int, params: dict | None, stream: bool = False,
         prompt: str = PROMPT):
    c = openai_client(url)
    body = {"kv_transfer_params": params} if params is not None else None
    kw = dict(model=c.models.list().data[0].id, max_tokens=max_tokens, temperature=0,
              messages=[{"role": "user", "content": prompt}], extra_body=body)
    if not stream:
        return c.chat.completions.create(**kw)
    text = "".join(ch.choices[0].delta.content or "" for ch in
                   c.chat.completions.create(stream=True, **kw) if ch.choices)
    return text


def imported(params: dict) -> int:
    """Prompt tokens a decode leg does not compute: the staged pages' and the tail block's
    but the last (computed for its logits)."""
    tail = params.get("tail")
    return params["num_tokens"] + (len(tail["tokens"]) - 1 if tail else 0)


def test_chat_handshake_equals_single_instance(pds):
    p, d, single = pds
    want = chat(single, 16, None).choices[0].message.content
    first = chat(p, 1, DO_REMOTE)
    params = first.model_extra["kv_transfer_params"]
    assert params is not None and params["num_tokens"] > 0 and params["tail"]["tokens"]
    out = chat(d, 16, params)
    assert out.choices[0].message.content == want
    assert out.usage.prompt_tokens_details.cached_tokens == imported(params)
    assert "kv_transfer_params" not in (out.model_extra or {})  # only a prefill leg gets them
    # streamed decode leg: a fresh prefill leg (the first params were released)
    params2 = chat(p, 1, DO_REMOTE).model_extra["kv_transfer_params"]
    assert chat(d, 16, params2, stream=True) == want


def test_completions_messages_responses_accept_the_params(pds):
    import anthropic
    p, d, single = pds
    c_single, c_p, c_d = (openai_client(u) for u in (single, p, d))
    model = c_single.models.list().data[0].id
    want = c_single.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                       temperature=0).choices[0].text
    first = c_p.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0,
                                   extra_body={"kv_transfer_params": DO_REMOTE})
    params = first.model_extra["kv_transfer_params"]
    out = c_d.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                 extra_body={"kv_transfer_params": params})
    assert out.choices[0].text == want
    assert out.usage.prompt_tokens_details.cached_tokens == imported(params)

    msgs = [{"role": "user", "content": PROMPT + " (messages)"}]
    a_single, a_p, a_d = (anthropic.Anthropic(base_url=u, api_key="unused", max_retries=0)
                          for u in (single, p, d))
    greedy = {"temperature": 0}  # (this client's create() has no temperature argument)
    want = a_single.messages.create(model=model, max_tokens=12, messages=msgs, extra_body=greedy)
    first = a_p.messages.create(model=model, max_tokens=1, messages=msgs,
                                extra_body={**greedy, "kv_transfer_params": DO_REMOTE})
    params = first.model_extra["kv_transfer_params"]
    out = a_d.messages.create(model=model, max_tokens=12, messages=msgs,
                              extra_body={**greedy, "kv_transfer_params": params})
    assert out.content[0].text == want.content[0].text
    assert out.usage.cache_read_input_tokens == imported(params)

    text = PROMPT + " (responses)"
    want = c_single.responses.create(model=model, input=text, max_output_tokens=12,
                                     temperature=0, store=False).output_text
    first = c_p.responses.create(model=model, input=text, max_output_tokens=1, temperature=0,
                                 store=False, extra_body={"kv_transfer_params": DO_REMOTE})
    params = first.model_extra["kv_transfer_params"]
    out = c_d.responses.create(model=model, input=text, max_output_tokens=12, temperature=0,
                               store=False, extra_body={"kv_transfer_params": params})
    assert out.output_text == want
    assert out.usage.input_tokens_details.cached_tokens == imported(params)


def test_bad_params_are_a_400_in_the_api_shape(pds):
    import anthropic
    import openai
    _, d, _ = pds
    c = openai_client(d)
    model = c.models.list().data[0].id
    for bad in ("not an object", {"remote_engine": "127.0.0.1:1"}):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=model, max_tokens=4, messages=[
                {"role": "user", "content": "hi"}], extra_body={"kv_transfer_params": bad})
        assert e.value.status_code == 400 and "kv_transfer_params" in str(e.value)
    a = anthropic.Anthropic(base_url=d, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                          extra_body={"kv_transfer_params": {"remote_engine": 5}})
    assert e.value.body["type"] == "error"


def test_prefill_killed_between_legs_decode_recomputes(cluster):
    """Runs last here: the prefill instance the tests above share is the victim."""
    (victim, proc), (d, _), (single, _) = cluster
    prompt = "A prompt the decode instance has never seen. " * 4
    want = chat(single, 16, None, prompt=prompt).choices[0].message.content
    params = chat(victim, 1, DO_REMOTE, prompt=prompt).model_extra["kv_transfer_params"]
    assert params is not None
    core_pid = httpx.get(victim + "/info").json()["pid"]  # the engine core's process
    assert core_pid != proc.pid  # (it holds the staged KV and the Transfer Engine)
    os.kill(core_pid, signal.SIGKILL)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{core_pid}/status") and \
            "zombie" not in open(f"/proc/{core_pid}/status").read():
        time.sleep(0.05)
    t0 = time.monotonic()
    out = chat(d, 16, params, prompt=prompt)
    assert out.choices[0].message.content == want
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # computed on the decode side
    assert time.monotonic() - t0 < TIMEOUT + 10
