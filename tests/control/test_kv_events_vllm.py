"""vLLM's own event classes decode what live loomserve instances publish, live and replayed, to
the same values loomserve meant: the bytes llm-d's precise prefix-cache scorer and Dynamo's KV
router read from a vLLM instance.

vLLM is never a loomserve dependency: a peer environment (benchmarks/.peers/vllm-events-venv,
built by benchmarks/peers/vllm_events_env.sh when absent) runs tests/control/vllm_decode.py on
the captured frames. Failing to build it fails the test: it is not skipped.
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
from pathlib import Path

import pytest
import zmq

from loomserve import LLM
from loomserve.kv.event_wire import END_SEQ, batch_decoder, seq_bytes, seq_of
from loomserve.kv.hashing import hash_chain
from tests.control.vllm_decode import batch_json
from tests.kv.connector.conftest import BS, OTHERS, POOL_BLOCKS, A, tiny_page_bytes
from tests.kv.test_event_publisher import GREEDY, flushed

ROOT = Path(__file__).resolve().parents[2]
PEER = ROOT / "benchmarks" / ".peers" / "vllm-events-venv"
BUILD = ROOT / "benchmarks" / "peers" / "vllm_events_env.sh"
FIXTURES = ROOT / "tests" / "fixtures"
HYBRID_PROMPT = list(range(3, 43))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    if not (PEER / ".ready").exists():
        t0 = time.monotonic()
        r = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, timeout=900)
        if r.returncode or not (PEER / ".ready").exists():
            pytest.fail(f"{BUILD} could not build the vLLM peer environment "
                        f"(rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        print(f"vLLM peer environment built in {time.monotonic() - t0:.0f} s")
    return str(PEER / "bin" / "python")


def capture(llm: LLM, work) -> tuple[list, list]:
    """(live frames a SUB socket got while `work` ran, every frame the replay socket holds)."""
    ready = llm.core.ready()
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ready.kv_events_endpoint)
    time.sleep(0.5)  # the SUB joins; what it misses is in the replay capture anyway
    try:
        work(llm)
        flushed(llm)
        live = []
        while sub.poll(500):
            live.append(sub.recv_multipart())
    finally:
        sub.close()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(ready.kv_events_replay_endpoint)
    replay = []
    try:
        dealer.send_multipart((b"", seq_bytes(0)))
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            replay.append([topic, seq, payload])
    finally:
        dealer.close()
    return live, replay


def llama_work(llm: LLM) -> None:
    for p in [A, *OTHERS]:  # the pool holds about two prompts: evictions; the host tier copies
        llm.generate(p, GREEDY)
    assert llm.core.tiers.store.flush(10)


def hybrid_work(llm: LLM) -> None:
    llm.generate(HYBRID_PROMPT, GREEDY)


@pytest.fixture(scope="module")
def decoded(vllm_python):
    """{"llama" | "hybrid": {"live" | "replay": (vLLM's decode, loomserve's decode)}}, all
    frames decoded by one peer process (importing vLLM is the slow part)."""
    page = tiny_page_bytes()
    runs = {
        "llama": (dict(model=str(FIXTURES / "tiny-llama"), block_size=BS,
                       kv_cache_memory=str(page * POOL_BLOCKS),
                       host_cache_memory=str(page * 64)), llama_work),
        "hybrid": (dict(model=str(FIXTURES / "tiny-qwen3-next"), block_size=4,
                        kv_cache_memory="1MiB"), hybrid_work)}
    # The peer imports vLLM (~15 s of one core) while the captures run on the other.
    peer = subprocess.Popen([vllm_python, str(ROOT / "tests/control/vllm_decode.py"), "-"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        captured = {}
        for name, (kw, work) in runs.items():
            llm = LLM(dtype="float32", device="cpu", kv_events_endpoint="tcp://127.0.0.1:0",
                      kv_events_topic=f"kv-{name}", **kw)
            try:
                live, replay = capture(llm, work)
            finally:
                llm.close()
            captured[(name, "live")] = live
            captured[(name, "replay")] = replay
        keys = list(captured)
        frames = [f for k in keys for f in captured[k]]
        doc = json.dumps({"frames": [[base64.b64encode(x).decode() for x in f] for f in frames]})
        stdout, stderr = peer.communicate(doc, timeout=600)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.communicate()
    assert peer.returncode == 0, stderr[-3000:]
    theirs = json.loads(stdout)
    assert len(theirs) == len(frames)
    dec = batch_decoder()
    out: dict = {}
    i = 0
    for name, part in keys:
        n = len(captured[(name, part)])
        ours = [batch_json(seq_of(f[1]), dec.decode(f[2])) for f in captured[(name, part)]]
        out.setdefault(name, {})[part] = (theirs[i:i + n], ours)
        i += n
    return out


def test_vllm_decodes_the_same_values(decoded):
    for name, parts in decoded.items():
        for part, (theirs, ours) in parts.items():
            assert theirs, (name, part)
            for t, o in zip(theirs, ours):
                assert t["topic"] == f"kv-{name}"
                assert t["modules"] == ["vllm.distributed.kv_events"]
                assert {k: t[k] for k in o} == o  # every field, as vLLM's classes read it
        theirs_replay = {d["seq"]: d for d in parts["replay"][0]}
        assert sorted(theirs_replay) == list(range(len(theirs_replay)))
        for d in parts["live"][0]:  # a live batch is the replayed batch of the same seq
            assert d == theirs_replay[d["seq"]]


def events(batches, type_, **match):
    return [e for b in batches for e in b["events"] if e["type"] == type_
            and all(e.get(k) == v for k, v in match.items())]


def test_vllm_reads_chains_media_and_removals(decoded):
    batches = decoded["llama"]["replay"][0]
    assert batches[0]["events"] == [{"type": "AllBlocksCleared"}]
    gpu = events(batches, "BlockStored", medium="GPU")
    first = gpu[:1]
    want = [h.hex() for h in hash_chain(A, BS)]
    got, parent = [], None
    for e in gpu:  # A's blocks come first, chained: parent of block k+1 is block k
        if len(got) == len(want):
            break
        assert e["parent_block_hash"] == parent
        got += e["block_hashes"]
        parent = e["block_hashes"][-1]
    assert got == want and first[0]["token_ids"] == A[:BS * len(first[0]["block_hashes"])]
    for e in gpu:
        assert (e["block_size"], e["group_idx"], e["kv_cache_spec_kind"]) == (
            BS, 0, "full_attention")
        assert e["lora_id"] is None and e["lora_name"] is None
    removed = {h for e in events(batches, "BlockRemoved", medium="GPU") for h in e["block_hashes"]}
    assert removed & set(want)  # OTHERS pushed A out of the device pool
    cpu = events(batches, "BlockStored", medium="CPU")
    assert cpu and all(e["token_ids"] == [] and e["ownership"] == "host" for e in cpu)
    assert {h for e in cpu for h in e["block_hashes"]} <= {
        h for e in gpu for h in e["block_hashes"]}


def test_vllm_reads_hybrid_groups(decoded):
    batches = decoded["hybrid"]["replay"][0]
    kinds = {e["group_idx"]: e["kv_cache_spec_kind"] for e in events(batches, "BlockStored")}
    assert sorted(set(kinds.values())) == ["full_attention", "mamba"] and len(kinds) >= 2
    full = [e for e in events(batches, "BlockStored") if e["kv_cache_spec_kind"] == "full_attention"]
    assert [h for e in full for h in e["block_hashes"]][:len(HYBRID_PROMPT) // 4] == [
        h.hex() for h in hash_chain(HYBRID_PROMPT, 4)]
