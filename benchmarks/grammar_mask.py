"""Grammar-constrained decoding cost: xgrammar vs llguidance on the default model's tokenizer.

Per library, for a realistic JSON schema and a tool-call grammar (two tools, Hermes format):
compile time, per-token mask fill for 1 and 32 concurrent matchers (the library's batched fill
where it has one), and applying the mask to [N, vocab] fp32 logits. The matchers walk a valid
output token by token (fill, then accept), so the masks are those of a real generation.

    .venv/bin/python benchmarks/grammar_mask.py [--tokens 64] [--steps 16]
    .venv/bin/python benchmarks/grammar_mask.py --engine 12   # the engine's step, with and without

The share of a decode step is taken against the default model's own plain decode step at the
same number of streams, measured in the same run (median of --steps steps), in both CPU modes:
fp32 weights (`--quantization none`) and the GGUF's blocks in place (`--quantization gguf`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.results import write_json  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "vip"]},
                 "maxItems": 5},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30}, "zip": {"type": "string"}},
            "required": ["city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
VALUE = {"name": "Ada Lovelace", "age": 36, "email": "ada@math.com", "tags": ["vip", "a"],
         "address": {"city": "London", "zip": "W1"}, "active": True}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [("get_weather", WEATHER), ("lookup_user", SCHEMA)]
CALL = ('<tool_call>\n{"name": "get_weather", "arguments": '
        + json.dumps({"city": "Paris", "unit": "c"}) + '}\n</tool_call>')


def tokenizer():
    from loomserve.config import EngineConfig
    from loomserve.engine.tokenizer import Tokenizer
    from loomserve.execution.models.loading.default import default_model_path
    from loomserve.execution.models.loading.gguf import cached_conversion

    cfg = EngineConfig.from_kwargs(model=None)
    folder = cached_conversion(default_model_path(), cfg.model.resolved_cache_dir)
    return Tokenizer.from_folder(folder).hf


def timed(fn, repeat=1):
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat * 1e3


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab):
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)
        self.vocab = vocab

    def compile(self, kind):
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        tags = [{"type": "tag", "begin": f'<tool_call>\n{{"name": "{n}", "arguments": ',
                 "content": {"type": "json_schema", "json_schema": s}, "end": "}\n</tool_call>"}
                for n, s in TOOLS]
        st = {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags,
                                                   "separator": "\n", "at_least_one": True}}
        return self.compiler.compile_structural_tag(json.dumps(st))

    def matchers(self, grammar, n):
        return [self.xgr.GrammarMatcher(grammar) for _ in range(n)]

    def bitmask(self, n):
        return self.xgr.allocate_token_bitmask(n, self.vocab)

    def fill(self, ms, bitmask):
        if len(ms) == 1:
            ms[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def accept(self, ms, tok):
        for m in ms:
            assert m.accept_token(tok)

    def apply(self, logits, bitmask):
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab):
        import llguidance as llg
        import llguidance.hf
        import llguidance.torch
        self.llg, self.lt = llg, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        self.executor = llg.LLExecutor(num_threads=2)
        self.vocab = vocab

    def compile(self, kind):
        llg = self.llg
        if kind == "json":
            g = llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                       defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        else:
            alts = " | ".join(f'"<tool_call>\\n{{\\"name\\": \\"{n}\\", \\"arguments\\": " '
                              f'%json{json.dumps(s)} "}}\\n</tool_call>"' for n, s in TOOLS)
            g = llg.LLMatcher.grammar_from_lark(f'start: call ("\\n" call)*\ncall: {alts}\n')
        m = llg.LLMatcher(self.tok, g)  # compiling happens when the matcher is built
        assert not m.is_error(), m.get_error()
        return g

    def matchers(self, grammar, n):
        return [self.llg.LLMatcher(self.tok, grammar) for _ in range(n)]

    def bitmask(self, n):
        return self.lt.allocate_token_bitmask(n, self.vocab)

    def fill(self, ms, bitmask):
        if len(ms) == 1:
            self.lt.fill_next_token_bitmask(ms[0], bitmask, 0)
        else:
            self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)],
                                               bitmask)

    def accept(self, ms, tok):
        for m in ms:
            assert m.consume_token(tok), m.get_error()

    def apply(self, logits, bitmask):
        self.lt.apply_token_bitmask_inplace(logits, bitmask)


def walk(lib, grammar, tokens, n):
    """Mean ms per decode step of: fill for n matchers, accept one token each, the library's
    apply, and the engine's own apply (loomserve.execution.logits_processors.apply_bitmask,
    device-agnostic torch, what the sampler runs)."""
    from loomserve.execution.logits_processors import apply_bitmask

    ms = lib.matchers(grammar, n)
    bitmask = lib.bitmask(n)
    logits = torch.randn(n, lib.vocab)
    rows = list(range(n))
    lib.fill(ms, bitmask)
    lib.apply(logits.clone(), bitmask)  # warm-up (first calls may compile kernels)
    apply_bitmask(logits.clone(), bitmask, rows, rows)
    fills, accepts, applies, ours = [], [], [], []
    for tok in tokens:
        fills.append(timed(lambda: lib.fill(ms, bitmask)))
        applies.append(timed(lambda: lib.apply(logits, bitmask)))
        ours.append(timed(lambda: apply_bitmask(logits, bitmask, rows, rows)))
        accepts.append(timed(lambda: lib.accept(ms, tok)))
    return [statistics.mean(x) for x in (fills, accepts, applies, ours)]


def engine(quantization: str = "none"):
    """The default model's offline engine in fp32 with `quantization` (one at a time: a new
    mode frees the last)."""
    from loomserve import LLM

    if ENGINE.get("mode") != quantization:
        ENGINE.clear()
        ENGINE.update(mode=quantization, llm=LLM(None, dtype="float32", quantization=quantization))
    return ENGINE["llm"]


def engine_steps(streams: int, steps: int, structured, quantization: str = "none"
                 ) -> tuple[float, float]:
    """Median (wall ms, process CPU ms) of the engine's decode steps (every stream decoding)
    for the default model."""
    from loomserve.sampling_params import SamplingParams

    llm = engine(quantization)
    core = llm.core
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True,
                            structured=structured)
    for i in range(streams):
        core.add(llm.inputs.make_core_request(f"b{streams}-{i}-{id(params)}",
                                              f"Write item {i} of the list:", params))
    times, cpu = [], []
    while core.has_work():
        decoding = not core.scheduler.waiting and all(
            r.num_tokens - r.num_computed_tokens == 1 for r in core.scheduler.running)
        t, c = time.perf_counter(), time.process_time()
        core.step()
        if decoding:
            times.append((time.perf_counter() - t) * 1e3)
            cpu.append((time.process_time() - c) * 1e3)
    return statistics.median(times), statistics.median(cpu)


ENGINE: dict = {}


def engine_main(steps: int) -> list[dict]:
    from loomserve.sampling_params import StructuredOutputs

    # A grammar that never ends early: every step of every stream is constrained.
    spec = StructuredOutputs(regex="[a-zA-Z ,.]{0,400}")
    rows = []
    for streams in (1, 32):
        engine_steps(streams, 2, spec)  # warm-up: model, grammar compiler, compile
        (plain, plain_cpu), (con, con_cpu) = (engine_steps(streams, steps, None),
                                              engine_steps(streams, steps, spec))
        print(f"engine, {streams:2d} streams, median decode step: plain {plain:7.1f} ms wall /"
              f" {plain_cpu:7.1f} ms CPU, constrained {con:7.1f} / {con_cpu:7.1f} ms "
              f"(CPU {(con_cpu / plain_cpu - 1) * 100:+5.1f}%)")
        rows.append({"streams": streams, "steps": steps, "plain_ms": plain,
                     "plain_cpu_ms": plain_cpu, "constrained_ms": con,
                     "constrained_cpu_ms": con_cpu})
    return rows


def plain_steps(steps: int) -> dict[str, dict[int, float]]:
    """Median wall ms of a plain decode step, per CPU mode and number of streams."""
    out: dict[str, dict[int, float]] = {}
    for mode in ("none", "gguf"):
        out[mode] = {}
        for streams in (1, 32):
            engine_steps(streams, 2, None, mode)  # warm-up
            out[mode][streams] = engine_steps(streams, steps, None, mode)[0]
            print(f"decode step, quantization {mode:4s}, {streams:2d} streams: "
                  f"{out[mode][streams]:7.1f} ms (median of {steps})")
    ENGINE.clear()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16,
                    help="decode steps per mode and stream count for the step the share is of")
    ap.add_argument("--engine", type=int, default=0, metavar="STEPS",
                    help="instead: the engine's decode step, plain vs grammar-constrained, "
                         "default model fp32, 1 and 32 streams, STEPS steps each; process CPU "
                         "time too (robust on a shared host with LOOMSERVE_NUM_THREADS=1)")
    ap.add_argument("--out", default=None,
                    help="result file (default: grammar_mask.json, grammar_mask-engine.json)")
    args = ap.parse_args()
    if args.engine:
        rows = engine_main(args.engine)
        write_json(args.out or "grammar_mask-engine.json", {"engine_decode_steps": rows})
        return
    step_ms = plain_steps(args.steps)
    results = []
    hf = tokenizer()
    vocab = 49152
    texts = {"json": json.dumps(VALUE, separators=(", ", ": ")), "tool call": CALL}
    print(f"CPU: {os.cpu_count()} cores; vocab {vocab}")
    missing = []
    for cls in (XGrammar, LLGuidance):
        t = time.perf_counter()
        try:
            lib = cls(hf, vocab)
        except ImportError as e:  # llguidance is a peer, not a loomserve dependency
            print(f"\n{cls.name}: not installed ({e}); pip install {cls.name} to compare")
            missing.append(cls.name)
            continue
        print(f"\n{lib.name}: tokenizer setup {(time.perf_counter() - t) * 1e3:.0f} ms")
        for kind in ("json", "tool call"):
            compile_ms = timed(lambda: lib.compile(kind))
            grammar = lib.compile(kind)
            tokens = hf.encode(texts[kind], add_special_tokens=False)[:args.tokens]
            for n in (1, 32):
                fill, accept, apply, ours = walk(lib, grammar, tokens, n)
                total = fill + accept + ours
                shares = {mode: total / step_ms[mode][n] for mode in step_ms}
                print(f"  {kind:9s} compile {compile_ms:6.1f} ms | {n:2d} streams: fill {fill:5.2f}"
                      f" accept {accept:5.2f} apply {apply:5.2f} (engine's {ours:5.2f}) ms/step;"
                      f" fill+accept+engine apply {total:5.2f} ms = "
                      f"{shares['none'] * 100:4.1f}% of an fp32 step, "
                      f"{shares['gguf'] * 100:4.1f}% of a gguf step")
                results.append({"library": lib.name, "grammar": kind, "compile_ms": compile_ms,
                                "streams": n, "fill_ms": fill, "accept_ms": accept,
                                "apply_ms": apply, "engine_apply_ms": ours,
                                "step_ms": {m: step_ms[m][n] for m in step_ms},
                                "share_of_step": shares})
    write_json(args.out or "grammar_mask.json",
               {"steps": args.steps, "tokens": args.tokens,
                "decode_step_ms": {m: {str(k): v for k, v in d.items()} for m, d in step_ms.items()},
                "results": results, "libraries_not_installed": missing})


if __name__ == "__main__":
    main()
