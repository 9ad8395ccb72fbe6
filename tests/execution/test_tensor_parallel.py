"""Tensor parallelism on CPU with gloo: 2 ranks (the engine's process + one worker process).

Oracle: the same engine at tensor_parallel_size 1. The all-reduce sums a row's partial products
in another order than one matmul does, so logits may differ in the last bits; on the tiny
fixtures greedy tokens are identical (the documented tolerance: identical greedy tokens; where a
model had near-ties, a different token after the first differing logit would be allowed).
Every rank runs with one torch thread.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomserve.execution.batch import ModelInput, ScheduledSeq
from loomserve.execution.parallel.step_message import (
    BlockSyncReceiver,
    BlockSyncSender,
    decode,
    encode,
)
from loomserve.sampling_params import SamplingParams
from tests.api.server.conftest import running_server
from tests.execution.tp_util import FIXTURES, GREEDY, SYSTEM, _fixture, _run, one_thread_per_rank  # noqa: F401


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_greedy_and_prefix_hits_match_one_rank(name):
    model = _fixture(name)
    tokens1, cached1, blocks1, page1 = _run(model, 1)
    tokens2, cached2, blocks2, page2 = _run(model, 2)
    assert tokens2 == tokens1
    assert cached2 == cached1 and cached1[2] >= 32 and cached1[3] >= 32  # the hits happened
    # each rank holds half the KV heads: half a page, so the same budget holds twice the blocks
    assert page2 * 2 == page1 and blocks2 == 2 * blocks1


@pytest.fixture(scope="module")
def one_kv_head_odd_vocab(tmp_path_factory):
    """tiny-llama's shape with ONE KV head (so at 2 ranks it is replicated, not split) and a
    vocabulary of 515 (not a multiple of 2: the last rank's slice is padded)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    src = _fixture("tiny-llama")
    out = tmp_path_factory.mktemp("tiny-llama-kv1")
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=515,
                      max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
                      eos_token_id=2, initializer_range=0.1)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), out / name)
    return str(out)


def test_replicated_kv_head_and_padded_vocab_match_one_rank(one_kv_head_odd_vocab):
    tokens1, cached1, blocks1, page1 = _run(one_kv_head_odd_vocab, 1)
    tokens2, cached2, blocks2, page2 = _run(one_kv_head_odd_vocab, 2)
    assert tokens2 == tokens1 and cached2 == cached1
    assert page2 == page1 and blocks2 == blocks1  # every rank holds the one KV head


def test_one_rank_keeps_todays_path():
    """tp 1: the in-process executor, no process group, no parallel layer, no step message."""
    from loomserve.config import EngineConfig
    from loomserve.engine.executor import UniProcExecutor, make_executor
    from loomserve.execution.layers.parallel_linear import RowParallelLinear
    from loomserve.execution.parallel.state import get_tp
    ex = make_executor(EngineConfig.from_kwargs(model=_fixture("tiny-llama"),
                                                kv_cache_memory="2MiB", dtype="float32"))
    model = ex.driver_runner.model
    assert type(ex) is UniProcExecutor and get_tp() is None and model.tp is None
    assert not any(isinstance(m, RowParallelLinear) for m in model.modules())


def test_unsupported_family_is_refused_before_any_process_starts():
    from loomserve.engine.llm import LLM
    from loomserve.execution.parallel.tensor_parallel import check_supported
    with pytest.raises(NotImplementedError, match="declares none"):  # e.g. a registered plugin
        check_supported(type("PluginForCausalLM", (), {}), None, 2, "none")
    from loomserve.execution.models.llama import LlamaForCausalLM
    with pytest.raises(NotImplementedError, match="declares none"):  # a plan is not inherited
        check_supported(type("PluginForCausalLM", (LlamaForCausalLM,), {}), None, 2, "none")
    with pytest.raises(ValueError, match="must divide"):  # 4 heads over 3 ranks
        LLM(_fixture("tiny-qwen3-next"), tensor_parallel_size=3, kv_cache_memory="2MiB")
    with pytest.raises(NotImplementedError, match="quantization int8"):
        LLM(_fixture("tiny-llama"), tensor_parallel_size=2, quantization="int8")
    with pytest.raises(NotImplementedError, match="prefill/decode roles"):
        LLM(_fixture("tiny-llama"), tensor_parallel_size=2, role="prefill")


def test_a_worker_failing_at_start_fails_the_engine_start_at_once(monkeypatch):
    from loomserve.engine.executor.multiproc import WorkerDied
    from loomserve.engine.llm import LLM
    monkeypatch.setenv("LOOMSERVE_WORKER_FAIL_AT_START", "1")
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match="rank 1 .* failed to start"):
        LLM(_fixture("tiny-llama"), tensor_parallel_size=2, kv_cache_memory="2MiB")
    assert time.monotonic() - t0 < 30  # not the rendezvous timeout (60 s)
    from loomserve.execution.parallel.state import get_tp
    assert get_tp() is None  # the failed start left no process group behind


def test_data_parallel_with_tensor_parallel_config():
    """DP x TP is accepted (each DP core its own TP group, CUDA devices per core, over nodes
    too); with expert parallelism it is refused clearly."""
    from loomserve.config import EngineConfig
    from loomserve.execution.parallel.state import device_offset
    pc = EngineConfig.from_kwargs(data_parallel_size=2, tensor_parallel_size=2).parallel
    assert pc.world_size == 2
    assert [device_offset(dataclasses.replace(pc, data_parallel_rank=d)) for d in (0, 1)] == [0, 2]
    with pytest.raises(ValueError, match="not supported yet"):
        EngineConfig.from_kwargs(data_parallel_size=2, tensor_parallel_size=2,
                                 enable_expert_parallel=True)
    over_nodes = EngineConfig.from_kwargs(data_parallel_size=4, tensor_parallel_size=2, nnodes=2,
                                          master_port=29500).parallel  # 2 cores per node
    assert [device_offset(dataclasses.replace(over_nodes, data_parallel_rank=d))
            for d in range(4)] == [0, 2, 0, 2]  # each node's cores from its own GPU 0
    assert list(over_nodes.node_ranks()) == [0, 1]  # a core's TP group stays on its node


def test_cli_parallel_flags():
    from loomserve.cli import build_parser, engine_config_from_args
    args = build_parser().parse_args(["serve", "m", "--tensor-parallel-size", "2", "--nnodes",
                                      "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                                      "--master-port", "29500"])
    pc = engine_config_from_args(args).parallel
    assert (pc.tensor_parallel_size, pc.nnodes, pc.node_rank) == (2, 2, 1)
    assert (pc.master_addr, pc.master_port, list(pc.node_ranks())) == ("10.0.0.1", 29500, [1])


# --- served -------------------------------------------------------------------------------------

def _worker_pids(core_pid: int) -> list[int]:
    with open(f"/proc/{core_pid}/task/{core_pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_served_tp2_answers_then_a_killed_worker_fails_requests_fast():
    import openai
    env = {"LOOMSERVE_STEP_DELAY_MS": "30"}  # a long stream is still running at the kill
    with running_server(tensor_parallel_size=2, core_env=env) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                               timeout=30)
        r = client.chat.completions.create(model=srv.model, max_tokens=5,
                                           messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
        workers = _worker_pids(srv.engine.ready.pid)
        assert len(workers) == 1
        stream = client.completions.create(model=srv.model, prompt="a", max_tokens=200,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(Exception):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 5
        with pytest.raises(openai.APIError) as err:
            client.completions.create(model=srv.model, prompt="b", max_tokens=2)
        assert time.monotonic() - t0 < 5
        dead = srv.engine.dead
        assert dead is not None and "rank 1" in dead.error, dead
        del err


# --- step message ---------------------------------------------------------------------------------

_step = st.lists(st.tuples(st.integers(0, 7),  # request id
                           st.integers(0, 3),  # blocks to append (per group)
                           st.booleans(),  # new list object (readmitted after preemption)
                           st.booleans()),  # finished after this step
                 max_size=6)


@settings(max_examples=60, deadline=None)
@given(st.lists(_step, min_size=1, max_size=12), st.integers(1, 2))
def test_step_message_round_trip_rebuilds_every_block_table(steps, groups):
    """Whatever the order of growth, readmission and finishing, the worker's block tables are
    the driver's after every step, and the bytes decode to the same message."""
    sender, receiver = BlockSyncSender(), BlockSyncReceiver()
    tables: dict[str, list[list[int]]] = {}
    next_block = 0
    finished: list[str] = []
    for step in steps:
        seqs, done = [], []
        for rid_n, grow, renew, finish in step:
            rid = f"r{rid_n}"
            if any(s.request_id == rid for s in seqs):
                continue
            if rid not in tables or renew:
                tables[rid] = [[] for _ in range(groups)]
            for ids in tables[rid]:
                ids.extend(range(next_block, next_block + grow))
                next_block += grow
            seqs.append(ScheduledSeq(rid, [rid_n, grow], 5 * rid_n, tables[rid], finish,
                                     SamplingParams()))
            if finish:
                done.append(rid)
        msg = sender.message(ModelInput(seqs, finished))
        data = encode(msg)
        assert decode(data) == msg
        got = receiver.model_input(decode(data))
        assert [(s.request_id, s.token_ids, s.start_pos, s.sample, s.block_ids)
                for s in got.seqs] == \
            [(s.request_id, s.token_ids, s.start_pos, s.sample, s.block_ids) for s in seqs]
        assert got.finished_request_ids == finished
        for rid in done:
            del tables[rid]
        finished = done


def test_two_nodes_rendezvous_at_master_addr_and_port():
    """--nnodes 2: node 1 (`loomserve serve --node-rank 1`) runs rank 1 headless; node 0's
    engine meets it at the given port, answers, and its shutdown ends node 1 cleanly."""
    import subprocess
    import sys

    from loomserve.engine.llm import LLM
    from tests.ports import free_port
    model, port = _fixture("tiny-llama"), free_port()
    node1 = subprocess.Popen([sys.executable, "-m", "loomserve.cli", "serve", model,
                              "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                              "--master-port", str(port), "--kv-cache-memory", "2MiB",
                              "--dtype", "float32"])
    try:
        llm = LLM(model, tensor_parallel_size=2, nnodes=2, master_port=port,
                  kv_cache_memory="2MiB", dtype="float32")
        try:
            out = llm.generate([SYSTEM], GREEDY)[0]
            assert len(out.token_ids) == GREEDY.max_tokens
        finally:
            llm.close()
        assert node1.wait(timeout=30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
