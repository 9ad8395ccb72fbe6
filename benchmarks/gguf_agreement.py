"""loomserve's GGUF loader against llama.cpp itself, on llama.cpp's own K-quant mixes.

What it shows (issue 43): on files that llama.cpp's own tools made -- ``convert_hf_to_gguf.py``
then ``llama-quantize`` into Q4_K_M, Q4_K_S, Q5_K_M, Q6_K and Q8_0 -- loomserve's next-token
log-probabilities, teacher-forced on the same token sequences, agree with llama-server's:
per mix, top-1 agreement (loomserve's argmax == llama's argmax) and the mean |logprob(loomserve)
- logprob(llama)| of each position's next token, for ``--quantization gguf`` (the file's blocks
run in place where loomserve has a kernel for the type) and ``none`` (dequantized to fp32).

The fixture (``--build-fixtures``; tests/fixtures/gguf-mixes/, committed, 0.6-1.1 MB a file):
  - a SentencePiece BPE tokenizer (384 pieces, no byte fallback) trained on the first 90% of
    docs/design/*.md -- a SentencePiece ``tokenizer.model`` makes the converter write a ``llama``
    (SPM) vocabulary, which needs no pre-tokenizer hash (the converter refuses BPE tokenizers
    whose hash it does not know);
  - a llama-architecture checkpoint, 2 layers, hidden 256, 4 heads (head_dim 64), 2 KV heads,
    intermediate 256, untied LM head: every row is 256 values long, so llama-quantize's K-quant
    types apply to every matrix (a row not a multiple of 256 falls back to another type: the
    built-in SmolLM2, hidden 576, gets Q5_0 for most of its "Q4_K_M");
  - *trained* (AdamW, 800 steps of 8 x 64 tokens, one thread, ~75 s) on the corpus's first
    12,000 characters until it knows them (loss ~0.25): next-token distributions of a language
    model on text it knows, peaked (mean entropy ~0.25 nats, top-1 p ~0.94, top-1 margin ~5.6
    nats), rather than the near-uniform ones of random weights, where top-1 agreement means
    little. Held-out text (the corpus's last 10%) is scored too, as a harder, broader case
    (entropy ~1.0-1.1 nats, top-1 p ~0.7); the bars apply to the first;
  - converted to F32 by the vendored ``convert_hf_to_gguf.py`` (run with the vendored gguf-py on
    PYTHONPATH, in a subprocess), then ``llama-quantize F32 -> MIX``. The GGUF type llama.cpp
    gave each tensor (its mix rules, fallbacks included) is read back with gguf-py and recorded.
  build.json beside the files records the training, the corpus (files, sha256) and the prompts.

The comparison, per mix and text (``train``: the model's training text; ``held_out``):
  - llama-server (``-t 2 -tb 2``, one slot, ``-c 256``, repacked layouts per
    common.llama_repack_args, otherwise its defaults) on the file. Sequences: 8 prompts of BOS +
    PROMPT_TOKENS - 1 tokens of the text (evenly spaced), then llama's own greedy continuation of
    GEN_TOKENS tokens. llama-server cannot echo prompt-token logprobs, so the prompt positions
    are teacher-forced one request per prefix (``n_predict`` 1, ``n_probs`` = the vocabulary,
    ``cache_prompt`` on, token ids sent as ids; no BOS is added, checked) and the continuation
    comes from one greedy request with ``n_probs`` = the vocabulary: every position gets
    llama's full distribution (raw logits, softmaxed by the server: ``post_sampling_probs`` off).
  - loomserve, in-process (its completions API has no ``prompt_logprobs``): a ModelRunner on
    the same file, fp32, ``--quantization gguf`` and ``none``, all sequences teacher-forced
    together one token a step (a decode batch): the log-softmax of each position's logits.
  - the exact reference: transformers' LlamaForCausalLM on the dequantized weights (loomserve's
    converted folder), to tell loomserve's error from llama.cpp's own (int8 activations per
    256-value block for K-quant products, f16 KV cache).
  - positions compared: every distinct context -- every position but BOS alone, which every
    sequence shares and counts once: 497 per mix and text. Per position: top-1 agreement
    (argmax == llama's argmax) and |logprob - llama's logprob| of the sequence's next token.
The recording of llama's side (the token sequences, per position llama's top-3 ids and
logprobs and the next token's logprob; training text only) goes to
tests/fixtures/gguf-mixes/llama_logprobs.json with the llama.cpp version, the tensor types and
the modules loomserve kept quantized; tests/execution/models/test_gguf_llamacpp.py checks
loomserve against it in CI, where llama.cpp is not built. llama-server's answers are
deterministic here: a rerun rewrote the recording byte for byte.

Speed-comparison model (not committed, ~100 MB): the built-in SmolLM2-135M-Instruct Q4_1 GGUF
requantized to Q4_K_M, written by ``--requantize-default`` as

    benchmarks/.peers/bin/llama-quantize --allow-requantize \\
        "$(python -c 'from loomserve.execution.models.loading.default import default_model_path; print(default_model_path())')" \\
        benchmarks/.peers/models/SmolLM2-135M-Instruct-Q4_K_M.gguf Q4_K_M 2

(requantizing from Q4_1 compounds two roundings: fine for speed, not for accuracy claims). Its
rows are 576 long, not a multiple of 256, so llama-quantize falls back for 180 of 272 tensors:
the file holds Q5_0 x 166 (q, k, v, o, gate, up), Q4_K x 16 and Q6_K x 14 (ffn_down, 1536 long),
Q8_0 x 15 (some attn_v, the tied embedding), F32 x 61 (norms): 98.9 MiB, 6.17 bits a weight.

Run:
    benchmarks/peers/build_llama_tools.sh               # llama-server + llama-quantize (~16 min once)
    python benchmarks/gguf_agreement.py                 # llama-server vs loomserve on the fixtures
    python benchmarks/gguf_agreement.py --build-fixtures   # retrain + reconvert + requantize first
    python benchmarks/gguf_agreement.py --requantize-default
Output: a table, benchmarks/results/gguf_agreement.json, and (rewritten) the recording
    tests/fixtures/gguf-mixes/llama_logprobs.json.
Needs: the loomserve venv, httpx; --build-fixtures also sentencepiece (pip install sentencepiece;
    not a loomserve dependency) and the vendored converter's imports (torch, numpy, safetensors).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    PEERS_DIR,
    REPO_ROOT,
    ServerProcess,
    format_table,
    free_port,
    llama_repack_args,
    write_json,
)

RESULT_NAME = "gguf_agreement.json"
MIXES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q8_0")
FIXTURE_DIR = os.path.join(REPO_ROOT, "tests", "fixtures", "gguf-mixes")
RECORDING = os.path.join(FIXTURE_DIR, "llama_logprobs.json")
STEM = "tiny-llama"
BUILD_TOOLS = os.path.join(REPO_ROOT, "benchmarks", "peers", "build_llama_tools.sh")
BIN_DIR = os.path.join(PEERS_DIR, "bin")
MODELS_DIR = os.path.join(PEERS_DIR, "models")

VOCAB = 384
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 256, 2, 4, 2
TRAIN_STEPS, TRAIN_BATCH, TRAIN_LEN, SEED = 800, 8, 64, 0
TRAIN_CHARS = 12_000  # the model's training text: the corpus's first 12,000 characters
NUM_SEQS, PROMPT_TOKENS, GEN_TOKENS = 8, 32, 32
TOP_K_RECORDED = 3
THREADS = 2
# The bars (per mix): top-1 agreement and mean |logprob difference|.
MIN_TOP1, MAX_MEAN_DLOGPROB = 0.99, 0.02


def fixture_path(mix: str) -> str:
    return os.path.join(FIXTURE_DIR, f"{STEM}-{mix}.gguf")


# --- llama.cpp: sources, tools, version -------------------------------------------------------

def llama_cpp_source() -> str:
    """The vendored llama.cpp tree benchmarks/peers/build_llama_server.sh builds from."""
    found = sorted(glob.glob(os.path.join(PEERS_DIR, "src", "*", "vendor", "llama.cpp")))
    if not found:
        raise FileNotFoundError(f"no llama.cpp sources under {PEERS_DIR}/src: run {BUILD_TOOLS}")
    return found[-1]


def llama_tool(name: str) -> str:
    """benchmarks/.peers/bin/<name>, building llama-server + llama-quantize when missing."""
    path = os.path.join(BIN_DIR, name)
    if not os.access(path, os.X_OK):
        subprocess.run(["bash", BUILD_TOOLS], check=True)
    return path


def llama_cpp_version() -> dict[str, str]:
    """llama-server --version's first line and the vendored tree's commit (and its sdist)."""
    out = subprocess.run([llama_tool("llama-server"), "--version"], capture_output=True,
                         text=True).stderr.strip() or ""
    src = llama_cpp_source()
    commit = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    return {"version": out.splitlines()[0] if out else "unknown", "commit": commit,
            "source": os.path.relpath(src, os.path.join(PEERS_DIR, "src")).split(os.sep)[0]}


# --- the fixture --------------------------------------------------------------------------------

def corpus_text() -> tuple[str, list[str]]:
    files = sorted(glob.glob(os.path.join(REPO_ROOT, "docs", "design", "*.md")))
    text = "\n".join(open(f, encoding="utf-8").read() for f in files)
    return text, [os.path.relpath(f, REPO_ROOT) for f in files]


def train_tokenizer(text: str, out_dir: str) -> str:
    import sentencepiece as spm

    lines = [ln for ln in text.splitlines() if ln.strip()]
    prefix = os.path.join(out_dir, "tokenizer")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=prefix, vocab_size=VOCAB, model_type="bpe",
        character_coverage=1.0, byte_fallback=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1, max_sentence_length=1 << 16, minloglevel=2)
    return prefix + ".model"


def encode(sp_model: str, text: str) -> list[int]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=sp_model)
    return [i for line in text.splitlines() if line.strip() for i in sp.encode(line)]


def train_model(ids: list[int], out_dir: str) -> dict[str, Any]:
    """Train the tiny llama on `ids` and save it as an HF folder; returns the training facts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    torch.set_num_threads(1)  # a small shared host: one thread is faster than two contending
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).train()
    data = torch.tensor(ids, dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=TRAIN_STEPS,
                                                pct_start=0.1)
    gen = torch.Generator().manual_seed(SEED)
    t0, losses = time.monotonic(), []
    for step in range(TRAIN_STEPS):
        starts = torch.randint(0, len(data) - TRAIN_LEN, (TRAIN_BATCH,), generator=gen)
        x = torch.stack([torch.cat([torch.tensor([1]), data[s:s + TRAIN_LEN - 1]]) for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == TRAIN_STEPS - 1:
            print(f"  step {step}: loss {losses[-1]:.3f}", file=sys.stderr, flush=True)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    return {"steps": TRAIN_STEPS, "batch": TRAIN_BATCH, "window": TRAIN_LEN,
            "final_loss": round(sum(losses[-20:]) / 20, 4), "seconds": round(time.monotonic() - t0)}


def convert_to_gguf(hf_dir: str, out: str) -> None:
    """The vendored convert_hf_to_gguf.py, with the vendored gguf-py first on PYTHONPATH."""
    src = llama_cpp_source()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(src, "gguf-py"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    subprocess.run([sys.executable, os.path.join(src, "convert_hf_to_gguf.py"), hf_dir,
                    "--outfile", out, "--outtype", "f32"], check=True, env=env)


def quantize(src: str, dst: str, mix: str, *, allow_requantize: bool = False) -> list[str]:
    argv = [llama_tool("llama-quantize"), *(["--allow-requantize"] if allow_requantize else []),
            src, dst, mix, str(THREADS)]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return argv


def tensor_types(path: str) -> dict[str, str]:
    """{GGUF tensor name: GGUF type name} as gguf-py reads the file."""
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def build_fixtures() -> dict[str, Any]:
    text, files = corpus_text()
    cut = int(len(text) * 0.9)
    cut = text.index("\n", cut) + 1  # split at a line break
    with tempfile.TemporaryDirectory(prefix="gguf-mixes-") as work:
        hf_dir = os.path.join(work, "hf")
        os.makedirs(hf_dir)
        sp_model = train_tokenizer(text[:cut], work)
        shutil.copy(sp_model, os.path.join(hf_dir, "tokenizer.model"))
        train_ids = encode(sp_model, text[:text.index("\n", TRAIN_CHARS) + 1])
        train = train_model(train_ids, hf_dir)
        f32 = os.path.join(work, f"{STEM}-F32.gguf")
        convert_to_gguf(hf_dir, f32)
        os.makedirs(FIXTURE_DIR, exist_ok=True)
        for mix in MIXES:
            quantize(f32, fixture_path(mix), mix)
        prompts = {"train": prompts_from(train_ids),
                   "held_out": prompts_from(encode(sp_model, text[cut:]))}
    doc = {"model": {"vocab": VOCAB, "hidden": HIDDEN, "intermediate": INTERMEDIATE,
                     "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS, "tied": False},
           "training": train,
           "corpus": {"files": files, "sha256": hashlib.sha256(text.encode()).hexdigest(),
                      "chars": len(text), "tokenizer_chars": cut,
                      "model_train_chars": TRAIN_CHARS, "model_train_tokens": len(train_ids)},
           "prompts": prompts, "llama_cpp": llama_cpp_version()}
    with open(os.path.join(FIXTURE_DIR, "build.json"), "w") as f:
        json.dump(doc, f)
        f.write("\n")
    return doc


def requantize_default() -> str:
    """The built-in model's Q4_1 GGUF requantized to Q4_K_M under benchmarks/.peers/models."""
    from loomserve.execution.models.loading.default import default_model_path

    os.makedirs(MODELS_DIR, exist_ok=True)
    dst = os.path.join(MODELS_DIR, "SmolLM2-135M-Instruct-Q4_K_M.gguf")
    argv = quantize(default_model_path(), dst, "Q4_K_M", allow_requantize=True)
    print("$ " + " ".join(argv), file=sys.stderr)
    return dst


# --- the sequences ------------------------------------------------------------------------------

def prompts_from(ids: Sequence[int]) -> list[list[int]]:
    """NUM_SEQS prompts: BOS + PROMPT_TOKENS - 1 tokens of `ids`, evenly spaced over them."""
    n = PROMPT_TOKENS - 1
    stride = (len(ids) - n) // NUM_SEQS
    return [[1, *ids[i * stride:i * stride + n]] for i in range(NUM_SEQS)]


# --- llama-server's side ------------------------------------------------------------------------

def _entry(prob: dict[str, Any], nxt: int) -> dict[str, Any]:
    """One position from llama-server's `completion_probabilities` item (all vocabulary ids)."""
    top = [(int(t["id"]), t["logprob"]) for t in prob["top_logprobs"]]
    lps = {i: (-math.inf if lp is None else float(lp)) for i, lp in top}
    if nxt not in lps:
        raise ValueError(f"token {nxt} missing from llama-server's distribution")
    entropy = -sum(math.exp(lp) * lp for lp in lps.values() if lp > -math.inf)
    return {"next": nxt, "next_logprob": round(lps[nxt], 6),
            "top": [[i, round(lp, 6)] for i, lp in top[:TOP_K_RECORDED]],
            "entropy": round(entropy, 5)}


def llama_record(path: str, prompts: list[list[int]], vocab: int) -> list[dict[str, Any]]:
    """Per prompt: the full token sequence (prompt + llama's greedy continuation) and, for each
    position 1.., llama-server's distribution over the next token (see the module docstring)."""
    import httpx

    port = free_port()
    argv = [llama_tool("llama-server"), "-m", path, "--host", "127.0.0.1", "--port", str(port),
            "-np", "1", "-c", "256", "-t", str(THREADS), "-tb", str(THREADS), "--no-webui",
            *llama_repack_args()]
    out = []
    with ServerProcess(argv, port, name="llama-server", startup_timeout=120) as server, \
            httpx.Client(base_url=server.base_url, timeout=120) as client:
        def complete(prompt: list[int], n: int) -> dict[str, Any]:
            r = client.post("/completion", json={
                "prompt": prompt, "n_predict": n, "temperature": 0.0, "n_probs": vocab,
                "cache_prompt": True, "ignore_eos": True, "return_tokens": True})
            r.raise_for_status()
            body = r.json()
            if body["tokens_evaluated"] != len(prompt):  # no BOS added to token-id prompts
                raise ValueError(f"llama-server evaluated {body['tokens_evaluated']} prompt "
                                 f"tokens for {len(prompt)} sent")
            return body

        for prompt in prompts:
            positions = []
            for i in range(1, len(prompt)):  # teacher-forced: one request per prefix
                prob = complete(prompt[:i], 1)["completion_probabilities"][0]
                positions.append(_entry(prob, prompt[i]))
            body = complete(prompt, GEN_TOKENS)  # llama's greedy continuation
            generated = [int(t) for t in body["tokens"]]
            assert len(generated) == GEN_TOKENS, body
            positions += [_entry(p, t) for p, t in zip(body["completion_probabilities"], generated)]
            out.append({"tokens": prompt + generated, "positions": positions})
    return out


# --- loomserve's side ---------------------------------------------------------------------------

def loomserve_runner(path: str, quantization: str, cache_dir: str | None = None):
    from loomserve.config import EngineConfig
    from loomserve.execution.model_runner import ModelRunner

    return ModelRunner(EngineConfig.from_kwargs(
        model=path, dtype="float32", device="cpu", kv_cache_memory="8MB",
        quantization=quantization, cache_dir=cache_dir))


def loomserve_logprobs(runner, sequences: list[list[int]]):
    """[seqs, len - 1, vocab] log-softmax of loomserve's logits at positions 1.., every sequence
    teacher-forced together, one token a step (a decode batch)."""
    import torch

    from loomserve.execution.batch import ModelInput, ScheduledSeq
    from loomserve.sampling_params import SamplingParams

    n = len(sequences[0])
    assert all(len(s) == n for s in sequences)
    per = -(-n // runner.block_size)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(sequences))]
    greedy = SamplingParams(temperature=0.0)
    rows = []
    for pos in range(n - 1):
        batch = [ScheduledSeq(f"s{i}", [s[pos]], pos, [tables[i]], True, greedy, 0)
                 for i, s in enumerate(sequences)]
        due, logits = runner.compute_logits(ModelInput(batch))
        assert [d.request_id for d in due] == [b.request_id for b in batch]
        rows.append(torch.log_softmax(logits.double(), -1))
    return torch.stack(rows, 1)


def transformers_logprobs(folder: str, sequences: list[list[int]]):
    """The exact reference: transformers' LlamaForCausalLM (fp32) on loomserve's dequantized HF
    folder of the file (gguf-py's dequantization), same layout as loomserve_logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor(sequences)).logits[:, :-1].double()
    return torch.log_softmax(logits, -1)


def module_types(runner, path: str) -> dict[str, dict[str, int]]:
    """{"quantized" | "float": {GGUF type(s): modules}} for the modules loomserve builds from the
    file's matrices: per layer q|k|v, o, gate|up, down; the embedding; an untied LM head. A fused
    module's key joins its parts' types ("Q4_K+Q4_K+Q6_K")."""
    import gguf

    from loomserve.execution.layers.quant import QuantLinear
    from loomserve.execution.models.loading.gguf import hf_name

    types = {hf_name(t.name): t.tensor_type.name for t in gguf.GGUFReader(path).tensors
             if len(t.shape) == 2}  # the matrices, not the norms' vectors
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    out: dict[str, dict[str, int]] = {"quantized": {}, "float": {}}
    for name, mod in runner.model.named_modules():
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{p}" for p in fused[leaf]] if leaf in fused else [name]
        if not all(f"{p}.weight" in types for p in parts):
            continue
        key = "+".join(types[f"{p}.weight"] for p in parts)
        kind = "quantized" if isinstance(mod, QuantLinear) else "float"
        out[kind][key] = out[kind].get(key, 0) + 1
    return {k: dict(sorted(v.items())) for k, v in out.items()}


def compare(recorded: list[dict[str, Any]], logprobs) -> dict[str, Any]:
    """Top-1 agreement and mean/max |dlogprob| of the next token, loomserve vs the recording,
    over distinct contexts: the first position (BOS alone) is the same in every sequence and
    counts once."""
    agree = n = 0
    diffs, margins = [], []
    for i, seq in enumerate(recorded):
        for p, pos in enumerate(seq["positions"]):
            if p == 0 and i > 0:
                continue
            row = logprobs[i, p]
            if int(row.argmax()) == pos["top"][0][0]:
                agree += 1
            else:  # llama's top-1 minus top-2 logprob where the two disagree
                margins.append(round(pos["top"][0][1] - pos["top"][1][1], 4))
            diffs.append(abs(float(row[pos["next"]]) - pos["next_logprob"]))
            n += 1
    return {"positions": n, "top1_agreement": agree / n,
            "mean_abs_dlogprob": sum(diffs) / n, "max_abs_dlogprob": max(diffs),
            "disagreement_llama_margins": sorted(margins)}


def peakedness(recorded: list[dict[str, Any]]) -> dict[str, float]:
    """How peaked llama's distributions are at the compared positions (nats)."""
    pos = [p for i, s in enumerate(recorded) for j, p in enumerate(s["positions"])
           if i == 0 or j > 0]  # BOS alone once (see compare)
    return {"mean_entropy": sum(p["entropy"] for p in pos) / len(pos),
            "mean_top1_prob": sum(math.exp(p["top"][0][1]) for p in pos) / len(pos),
            "mean_top1_margin": sum(p["top"][0][1] - p["top"][1][1] for p in pos) / len(pos),
            "positions_margin_below_0.1": sum(p["top"][0][1] - p["top"][1][1] < 0.1 for p in pos)}


# --- the run ------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-fixtures", action="store_true",
                    help="retrain, reconvert and requantize the fixtures first")
    ap.add_argument("--requantize-default", action="store_true",
                    help="only write the built-in model requantized to Q4_K_M, then exit")
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=MIXES)
    ap.add_argument("--out", default=RESULT_NAME)
    args = ap.parse_args(argv)
    if args.requantize_default:
        print(requantize_default())
        return 0
    if args.build_fixtures:
        build_fixtures()
    with open(os.path.join(FIXTURE_DIR, "build.json")) as f:
        build = json.load(f)
    version = llama_cpp_version()
    import torch

    torch.set_num_threads(THREADS)
    results, recording = {}, {}
    with tempfile.TemporaryDirectory(prefix="gguf-agreement-") as cache:
        for mix in args.mixes:
            path = fixture_path(mix)
            t0 = time.monotonic()
            recorded = {name: llama_record(path, prompts, build["model"]["vocab"])
                        for name, prompts in build["prompts"].items()}
            print(f"[{mix}] llama-server recorded in {time.monotonic() - t0:.0f}s",
                  file=sys.stderr, flush=True)
            types = tensor_types(path)
            entry: dict[str, Any] = {"file": os.path.relpath(path, REPO_ROOT),
                                     "bytes": os.path.getsize(path), "tensor_types": types,
                                     "loomserve_modules": {}, "sets": {}}
            for name, rec in recorded.items():
                entry["sets"][name] = {"llama": peakedness(rec)}
            for quant in ("gguf", "none"):
                runner = loomserve_runner(path, quant, cache)
                entry["loomserve_modules"][quant] = module_types(runner, path)
                for name, rec in recorded.items():
                    seqs = [s["tokens"] for s in rec]
                    lp = loomserve_logprobs(runner, seqs)
                    entry["sets"][name][quant] = compare(rec, lp)
                    if quant == "none":  # loomserve's fp32 path against transformers, exact
                        ref = transformers_logprobs(runner.model_folder, seqs)
                        entry["sets"][name]["transformers"] = {
                            **compare(rec, ref),
                            "max_abs_dlogprob_vs_loomserve_none": float((ref - lp).abs().max())}
                del runner
            bars = entry["sets"]["train"]
            entry["passes"] = all(bars[q]["top1_agreement"] >= MIN_TOP1
                                  and bars[q]["mean_abs_dlogprob"] <= MAX_MEAN_DLOGPROB
                                  for q in ("gguf", "none"))
            results[mix] = entry
            recording[mix] = {"file": os.path.basename(path), "tensor_types": types,
                              "loomserve_modules_gguf": entry["loomserve_modules"]["gguf"],
                              "sequences": recorded["train"]}
    doc = {"llama_cpp": version, "threads": THREADS,
           "sequences": {"count": NUM_SEQS, "prompt_tokens": PROMPT_TOKENS,
                         "generated_tokens": GEN_TOKENS},
           "bars": {"set": "train", "min_top1_agreement": MIN_TOP1,
                    "max_mean_abs_dlogprob": MAX_MEAN_DLOGPROB}}
    write_json(args.out, {**doc, "fixture": {k: build[k] for k in ("model", "training", "corpus")},
                          "mixes": results})
    if set(args.mixes) == set(MIXES):
        with open(RECORDING, "w") as f:
            json.dump({**doc, "mixes": recording}, f, separators=(",", ":"))
            f.write("\n")
    print(summary_table(results))
    print(f"llama.cpp {version['version']} ({version['commit'][:12]})")
    return 0 if all(e["passes"] for e in results.values()) else 1


def summary_table(results: dict[str, Any]) -> str:
    rows = []
    for mix, e in results.items():
        counts: dict[str, int] = {}
        for t in e["tensor_types"].values():
            counts[t] = counts.get(t, 0) + 1
        kept = sum(e["loomserve_modules"]["gguf"]["quantized"].values())
        total = kept + sum(e["loomserve_modules"]["gguf"]["float"].values())
        for name, st in e["sets"].items():
            rows.append([mix, name, " ".join(f"{k}:{v}" for k, v in sorted(counts.items())),
                         st["llama"]["mean_entropy"], st["llama"]["mean_top1_prob"],
                         st["gguf"]["positions"], 100 * st["gguf"]["top1_agreement"],
                         f"{st['gguf']['mean_abs_dlogprob']:.4f}",
                         100 * st["none"]["top1_agreement"],
                         f"{st['none']['mean_abs_dlogprob']:.4f}", f"{kept}/{total}"])
    return format_table(["mix", "text", "tensor types", "entropy", "top1 p", "positions",
                         "gguf top1 %", "gguf |dlp|", "none top1 %", "none |dlp|",
                         "kept quantized"], rows)

if __name__ == "__main__":
    sys.exit(main())
