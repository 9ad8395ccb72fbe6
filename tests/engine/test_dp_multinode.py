"""Data parallelism over two nodes (loomserve.engine.dp_remote), both on this host: node
0's front end with its core, node 1 a headless `loomserve serve --node-rank 1` whose core
connects over TCP. Greedy outputs equal dp 1's and both ranks serve; DEP (the MoE fixture's
experts sharded over the two nodes' ranks) equals dp 1 too; a SIGKILLed remote node fails its
in-flight requests within 5 s (never a hang); a front end that goes away stops node 1."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from loomserve import SamplingParams
from loomserve.config import ParallelConfig
from loomserve.engine.async_llm import EngineDeadError
from tests.execution.tp_util import _fixture

ENV = {"LOOMSERVE_NUM_THREADS": "1"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[3, 4, 5, 6, 7] * 4, [9, 10, 11] * 7, list(range(20, 45)), [7] * 30]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)


def free_port_block(n: int) -> int:
    """A port p with p .. p + n free (checked, not reserved: the test binds them at once)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65536:
            continue
        try:
            socks = []
            for p in range(base, base + n + 1):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free port block")


def start_node1(model: str, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "loomserve", "serve", model, "--nnodes", "2", "--node-rank", "1",
         "--data-parallel-size", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--dtype", "float32", "--kv-cache-memory", "2MiB", *extra],
        env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def node0(model: str, port: int, **extra):
    from loomserve.config import EngineConfig
    from loomserve.engine.async_llm import AsyncLLM
    return AsyncLLM(EngineConfig.from_kwargs(
        model=model, data_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
        master_port=port, dtype="float32", kv_cache_memory="2MiB", **extra))


async def final(engine, prompt, params=GREEDY):
    last = None
    async for out in engine.generate(prompt, params):
        last = out
    return last


def dp1(model: str) -> list:
    from loomserve.engine.llm import LLM
    llm = LLM(model, dtype="float32", kv_cache_memory="2MiB")
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.close()


def wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
        raise AssertionError(f"node 1 did not exit within {timeout} s:\n{out[-3000:]}") from None


def test_config_layout_and_refusals():
    pc = ParallelConfig(data_parallel_size=4, nnodes=2, node_rank=1, master_port=30000)
    assert list(pc.dp_node_ranks()) == [2, 3] and list(pc.dp_node_ranks(0)) == [0, 1]
    assert pc.remote_core_ports(3) == (30007, 30008)
    assert pc.tp_rendezvous() == ("127.0.0.1", 0)  # a DP core's TP group stays on its node
    assert pc.dp_rendezvous() == ("127.0.0.1", 30000)
    assert list(pc.node_ranks()) == [0]
    with pytest.raises(ValueError, match="does not split evenly"):
        ParallelConfig(data_parallel_size=3, nnodes=2, master_port=30000)
    with pytest.raises(ValueError, match="--master-port is required"):
        ParallelConfig(data_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="is not a port"):
        ParallelConfig(data_parallel_size=2, nnodes=2, master_port=65533)


@pytest.mark.parametrize("name,extra", [("tiny-llama", {}),
                                        ("tiny-deepseek-v3", {"enable_expert_parallel": True})])
def test_two_nodes_greedy_matches_dp1_and_node1_stops_with_the_front_end(name, extra):
    model = _fixture(name)
    want = dp1(model)
    port = free_port_block(4)
    proc = start_node1(model, port, *(["--enable-expert-parallel"] if extra else []))
    try:
        engine = node0(model, port, **extra)
        try:
            async def all_prompts():
                return await asyncio.gather(*(final(engine, p) for p in PROMPTS))
            outs = asyncio.run(asyncio.wait_for(all_prompts(), 120))
            got = [o.token_ids for o in outs]
            client = engine.client
            assert [type(c).__name__ for c in client.clients] == ["ProcCoreClient",
                                                                  "RemoteCoreClient"]
            deadline = time.monotonic() + 5  # stats trail the outputs by up to 50 ms
            while not all(s.generation_tokens for s in client.rank_stats) and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
            served = [s.generation_tokens for s in client.rank_stats]
        finally:
            engine.shutdown()
        assert got == want
        assert wait_exit(proc, 20) == 0  # the front end's Shutdown reached node 1
        assert all(n > 0 for n in served), served  # both nodes served (DP placement)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_killed_node_fails_in_flight_requests_fast():
    model = _fixture("tiny-llama")
    port = free_port_block(4)
    proc = subprocess.Popen([
        sys.executable, "-m", "loomserve", "serve", model, "--nnodes", "2", "--node-rank", "1",
        "--data-parallel-size", "2", "--master-port", str(port), "--dtype", "float32",
        "--kv-cache-memory", "2MiB"], env={**os.environ, **ENV, "LOOMSERVE_STEP_DELAY_MS": "50"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    engine = node0(model, port)
    try:
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

        async def main():
            tasks = [asyncio.create_task(final(engine, p, long)) for p in PROMPTS[:2]]
            while not all(s.generation_tokens > 0 for s in engine.client.rank_stats):
                assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
                await asyncio.sleep(0.05)
            os.kill(proc.pid, signal.SIGKILL)  # the launcher; its cores die with it
            killed = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
            return results, time.monotonic() - killed

        results, waited = asyncio.run(asyncio.wait_for(main(), 120))
        assert waited < 5.0
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors and all(isinstance(e, EngineDeadError) for e in errors), results
        assert any("data-parallel rank 1" in str(e) for e in errors)
    finally:
        engine.shutdown()
        proc.kill()
        proc.wait()


def test_node1_stops_when_the_front_end_is_killed():
    """No Shutdown ever comes: node 1's core sees its TCP connection break and exits, and the
    node's launcher with it (never a core left serving nobody)."""
    import httpx
    model = _fixture("tiny-llama")
    port = free_port_block(4)
    node1 = start_node1(model, port)
    http = port
    while port <= http <= port + 4:  # the block was released: the OS may hand out one of it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            http = s.getsockname()[1]
    front = subprocess.Popen(
        [sys.executable, "-m", "loomserve", "serve", model, "--nnodes", "2", "--node-rank", "0",
         "--data-parallel-size", "2", "--master-port", str(port), "--dtype", "float32",
         "--kv-cache-memory", "2MiB", "--port", str(http)],
        env={**os.environ, **ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert front.poll() is None and node1.poll() is None, "a node exited at start"
            try:
                if httpx.get(f"http://127.0.0.1:{http}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the two-node server never became healthy"
            time.sleep(0.2)
        front.send_signal(signal.SIGKILL)
        front.wait()
        assert wait_exit(node1, 15) == 0  # a lost front end is a stop, not a failure
    finally:
        for p in (front, node1):
            if p.poll() is None:
                p.kill()
                p.wait()
