"""loomserve against llama.cpp itself, on files llama.cpp's own tools made (issue 43).

tests/fixtures/gguf-mixes/ holds a tiny llama (2 layers, hidden 256 so every row takes K-quants,
vocab 384), trained until it knows 12,000 characters of docs/design (so its next-token
distributions there are a language model's and peaked: mean entropy 0.25 nats, top-1 p 0.94 at
the scored positions -- not the near-uniform ones of random weights), converted by llama.cpp's
convert_hf_to_gguf.py and quantized by its llama-quantize into Q4_K_M, Q4_K_S, Q5_K_M, Q6_K and
Q8_0; and llama_logprobs.json: what llama-server (llama.cpp 0c1e570) said about 8 sequences of
that text (31 prompt tokens after BOS, teacher-forced, then its 32 greedy tokens) on each file --
per position its top-3 ids and logprobs and the next token's logprob -- with the GGUF type
llama-quantize gave every tensor. benchmarks/gguf_agreement.py built both; it needs llama.cpp
built, which CI cannot afford.

Here, without llama.cpp: each file loads with ``--quantization gguf``, the sequences are
teacher-forced, and per mix loomserve's argmax must equal llama's at >= 99% of the 497 distinct
contexts and the mean |logprob difference| of the next token must be <= 0.02 (the issue's bars;
recorded: 99.6-100% and 0.0014-0.0042). Also checked: each tensor's type is the recorded one (a
change to llama.cpp's mix rules or to the fixture shows here), and loomserve keeps at least as
many modules in place per type combination as when the recording was made: then all 10 of every
mix (Q4_K, Q5_K, Q6_K, Q8_0, and q|k|v of mixed Q4_K/Q6_K), so a loader change that drops a
K-quant kernel fails here.
"""

from __future__ import annotations

import json

import pytest
import torch

from loomserve.config import EngineConfig
from loomserve.execution.batch import ModelInput, ScheduledSeq
from tests.execution.models.conftest import FIXTURES, GREEDY

gguf = pytest.importorskip("gguf")

FOLDER = FIXTURES / "gguf-mixes"
MIXES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q8_0")
MIN_TOP1, MAX_MEAN_DLOGPROB = 0.99, 0.02
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def recording() -> dict:
    with open(FOLDER / "llama_logprobs.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("gguf-cache"))


def _runner(mix: str, cache_dir: str):
    from loomserve.execution.model_runner import ModelRunner

    return ModelRunner(EngineConfig.from_kwargs(
        model=str(FOLDER / f"tiny-llama-{mix}.gguf"), dtype="float32", device="cpu",
        kv_cache_memory="8MB", quantization="gguf", cache_dir=cache_dir))


def _teacher_forced(runner, sequences: list[list[int]]) -> torch.Tensor:
    """[seqs, len - 1, vocab] log-softmax at positions 1.., all sequences one token a step."""
    n = len(sequences[0])
    per = -(-n // runner.block_size)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(sequences))]
    rows = []
    for pos in range(n - 1):
        batch = [ScheduledSeq(f"s{i}", [s[pos]], pos, [tables[i]], True, GREEDY, 0)
                 for i, s in enumerate(sequences)]
        due, logits = runner.compute_logits(ModelInput(batch))
        assert [d.request_id for d in due] == [b.request_id for b in batch]
        rows.append(torch.log_softmax(logits.double(), -1))
    return torch.stack(rows, 1)


def _module_types(runner, path) -> dict[str, dict[str, int]]:
    """{"quantized" | "float": {GGUF type(s) of the module's parts: count}} over the modules
    built from the file's matrices (as benchmarks/gguf_agreement.py counts them)."""
    from loomserve.execution.layers.quant import QuantLinear
    from loomserve.execution.models.loading.gguf import hf_name

    types = {hf_name(t.name): t.tensor_type.name for t in gguf.GGUFReader(path).tensors
             if len(t.shape) == 2}
    out: dict[str, dict[str, int]] = {"quantized": {}, "float": {}}
    for name, mod in runner.model.named_modules():
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{p}" for p in _FUSED[leaf]] if leaf in _FUSED else [name]
        if not all(f"{p}.weight" in types for p in parts):
            continue
        key = "+".join(types[f"{p}.weight"] for p in parts)
        kind = "quantized" if isinstance(mod, QuantLinear) else "float"
        out[kind][key] = out[kind].get(key, 0) + 1
    return out


def test_recording_covers_every_mix(recording):
    assert set(recording["mixes"]) == set(MIXES)
    assert recording["llama_cpp"]["commit"] and recording["llama_cpp"]["version"]
    for mix in MIXES:
        seqs = recording["mixes"][mix]["sequences"]
        assert len(seqs) == 8 and all(len(s["positions"]) == len(s["tokens"]) - 1 for s in seqs)


@pytest.mark.parametrize("mix", MIXES)
def test_tensor_types_are_llama_quantize_s(mix, recording):
    """Every tensor has the GGUF type llama-quantize gave it when the recording was made: the
    K-quant mixes really are mixes (Q4_K_M: Q4_K with Q6_K for the last layer's attn_v and
    ffn_down and for the LM head; Q4_K_S: Q5_K attn_v; ...), nothing fell back silently."""
    path = FOLDER / f"tiny-llama-{mix}.gguf"
    got = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert got == recording["mixes"][mix]["tensor_types"]
    base = {"Q4_K_M": "Q4_K", "Q4_K_S": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "Q8_0": "Q8_0"}
    assert got["blk.0.attn_q.weight"] == base[mix]


@pytest.mark.parametrize("mix", MIXES)
def test_logprobs_agree_with_llama_server(mix, recording, cache_dir):
    """Teacher-forced next-token logprobs, loomserve (--quantization gguf, fp32) vs llama-server
    on the same file: top-1 agreement >= 99% and mean |dlogprob| <= 0.02 of the next token."""
    rec = recording["mixes"][mix]
    runner = _runner(mix, cache_dir)
    kept = _module_types(runner, FOLDER / f"tiny-llama-{mix}.gguf")
    want = rec["loomserve_modules_gguf"]
    assert (sum(kept["quantized"].values()) + sum(kept["float"].values())
            == sum(want["quantized"].values()) + sum(want["float"].values()))
    for combo, n in want["quantized"].items():  # never fewer kept in place than recorded
        assert kept["quantized"].get(combo, 0) >= n, (combo, kept)

    seqs = rec["sequences"]
    lp = _teacher_forced(runner, [s["tokens"] for s in seqs])
    agree, diffs = 0, []
    for i, s in enumerate(seqs):
        for p, pos in enumerate(s["positions"]):
            if p == 0 and i > 0:  # BOS alone: the same context in every sequence, counted once
                continue
            agree += int(lp[i, p].argmax()) == pos["top"][0][0]
            diffs.append(abs(float(lp[i, p, pos["next"]]) - pos["next_logprob"]))
    top1, mean = agree / len(diffs), sum(diffs) / len(diffs)
    assert top1 >= MIN_TOP1 and mean <= MAX_MEAN_DLOGPROB, (mix, top1, mean, kept)
