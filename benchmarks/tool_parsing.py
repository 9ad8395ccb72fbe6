"""Output parsing overhead per generated token: ChatOutputParser (reasoning + tool parser) fed
one token's text at a time, per tool-call format, over realistic outputs with and without calls.

Outputs (seeded): "prose" is reasoning (~300 words, in the family's reasoning format) and an
answer (~300 words) with no call; "calls" is short reasoning, a sentence, then two calls in the
family's format: write_file with ~1.5 KB of Python source in a string argument (quotes,
newlines, escapes) and a small get_weather call. Token texts: the format's markers are one token
each (they are special or added tokens), the rest is split like a BPE vocabulary would (words of
up to 6 letters with their leading space, up to 3 digits, 1-2 punctuation characters, runs of
whitespace): ~3.5 characters per token. Each case runs --reps times on a fresh parser; we report
the median over repetitions of total time / tokens (µs per token), the 99th percentile of single
feed() calls (one instrumented repetition), and that cost as a share of a decode step
(--step-ms, 10 ms by default) for one stream and for --streams streams parsed by one front-end
process in the same step.

Usage: python benchmarks/tool_parsing.py [--reps 20] [--step-ms 10] [--streams 64]
Writes benchmarks/results/tool_parsing.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common.host import host_info  # noqa: E402
from common.results import format_table, write_json  # noqa: E402

from loomserve.api.chat.output_parser import ChatOutputParser  # noqa: E402
from loomserve.api.reasoning import get_reasoning_parser  # noqa: E402
from loomserve.api.tool_parsers import get_tool_parser  # noqa: E402

WORDS = ("the of and to in is that for it as with was on be by this are or from at which "
         "request cache token model server weather function value result parse stream block "
         "session prefix agent tool argument latency memory schedule decode prefill").split()
CODE = "".join(
    f'def handler_{i}(request, cache={{}}):\n    """Serve request {i}."""\n'
    f'    key = request.get("key", "k{i}")\n    if key in cache:\n        return cache[key]\n'
    f'    value = f"{{key}}\\t{i}" + "\\n"\n    cache[key] = value\n    return value\n\n'
    for i in range(7))
WRITE = ("write_file", {"path": "src/handlers.py", "content": CODE})
WEATHER = ("get_weather", {"city": "Paris", "days": 3, "metric": True})
FORMATS = {  # tool parser -> reasoning parser of a model family that writes it
    "hermes": "qwen3", "qwen3_coder": "qwen3", "llama3_json": None, "mistral": None,
    "deepseek_v3": "deepseek_r1", "kimi_k2": "qwen3", "glm45": "qwen3", "harmony": "gpt_oss",
}
MARKERS = re.compile("(" + "|".join(re.escape(m) for m in sorted({
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]",
    "[ARGS]", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|channel|>",
    "<|message|>", "<|end|>", "<|start|>", "<|call|>", "<|return|>", "<|constrain|>",
}, key=len, reverse=True)) + ")")
PIECE = re.compile(r"\s?[A-Za-z]{1,6}|\s?\d{1,3}|\s?[^\sA-Za-z\d]{1,2}|\s+")


def tokens_of(text: str) -> list[str]:
    out = []
    for part in MARKERS.split(text):
        out += [part] if MARKERS.fullmatch(part) else PIECE.findall(part)
    assert "".join(out) == text
    return out


def prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def calls_text(fmt: str) -> str:
    calls = [WRITE, WEATHER]
    if fmt == "qwen3_coder":
        return "".join("<tool_call>\n<function=%s>\n%s</function>\n</tool_call>\n" % (name, "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
            for k, v in args.items())) for name, args in calls)
    if fmt == "glm45":
        return "".join("<tool_call>%s\n%s</tool_call>\n" % (name, "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>"
            f"{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
            for k, v in args.items())) for name, args in calls)
    cls = get_tool_parser(fmt)
    parts = []
    for name, args in calls:
        f = cls.call_format(name, {})
        parts.append(f.begin + json.dumps(args) + f.end)
    return cls.call_separator.join(parts)


def output(fmt: str, kind: str, rng: random.Random) -> str:
    reasoning = prose(rng, 300 if kind == "prose" else 40)
    answer = prose(rng, 300) if kind == "prose" else "I will write the file and check. "
    body = answer + ("" if kind == "prose" else calls_text(fmt))
    if fmt == "harmony":
        head = f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant"
        if kind == "prose":
            return head + f"<|channel|>final<|message|>{answer}<|return|>"
        return head + f"<|channel|>commentary<|message|>{answer}<|end|><|start|>assistant" + \
            calls_text(fmt)
    if FORMATS[fmt] == "deepseek_r1":
        return f"{reasoning}\n</think>\n\n{body}"  # R1 starts inside the reasoning
    if FORMATS[fmt]:
        return f"<think>\n{reasoning}\n</think>\n\n{body}"
    return body


def parser_for(fmt: str | None) -> ChatOutputParser:
    if fmt is None:
        return ChatOutputParser(None, None)
    reasoning = FORMATS[fmt]
    return ChatOutputParser(get_tool_parser(fmt)(),
                            get_reasoning_parser(reasoning)() if reasoning else None)


def measure(fmt: str | None, toks: list[str], reps: int) -> tuple[float, float]:
    """(median µs per token over reps, p99 µs of one feed call)."""
    per_token = []
    for _ in range(reps):
        p = parser_for(fmt)
        t0 = time.thread_time_ns()
        for t in toks:
            p.feed(t)
        p.finish()
        per_token.append((time.thread_time_ns() - t0) / 1e3 / len(toks))
    p, feeds = parser_for(fmt), []
    for t in toks:
        t0 = time.thread_time_ns()
        p.feed(t)
        feeds.append((time.thread_time_ns() - t0) / 1e3)
    return statistics.median(per_token), statistics.quantiles(feeds, n=100)[98]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--streams", type=int, default=64)
    args = ap.parse_args()
    rows, records = [], []
    for fmt in [None, *FORMATS]:
        for kind in ("prose", "calls"):
            text = output(fmt or "hermes", kind, random.Random(0))
            toks = tokens_of(text)
            p = parser_for(fmt)  # the parse must be right before it is timed
            for t in toks:
                p.feed(t)
            p.finish()
            result = p.result()
            if fmt is not None:
                want = 2 if kind == "calls" else 0
                assert len(result.tool_calls or []) == want, (fmt, kind, result)
            us, p99 = measure(fmt, toks, args.reps)
            share = us / (args.step_ms * 1e3)
            name = fmt or "(no parser)"
            rows.append([name, kind, len(toks), round(len(text) / len(toks), 2), us, p99,
                         100 * share, 100 * share * args.streams])
            records.append({"format": name, "output": kind, "tokens": len(toks),
                            "chars_per_token": len(text) / len(toks), "us_per_token": us,
                            "p99_feed_us": p99, "share_of_step": share,
                            "share_of_step_all_streams": share * args.streams})
    headers = ["format", "output", "tokens", "chars/tok", "us/token", "p99 feed us",
               f"% of {args.step_ms:g} ms step", f"% x{args.streams} streams"]
    print(format_table(headers, rows))
    path = write_json("tool_parsing.json", {
        "host": host_info(), "args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                          time.gmtime()),
        "results": records})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
