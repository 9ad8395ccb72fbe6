"""Prefix-cache hit rate of a multi-turn tool conversation through each API.

A scripted agent loop of --turns turns runs against a real `loomserve serve`: the user's task,
then each turn the model calls a tool (forced: tool_choice required / Anthropic's "any"), the
tool returns a few hundred tokens of fake file content, and the next request resends the whole
history exactly as that API's official client would. Four conversations, one per API shape:

  chat        Chat Completions: messages with the assistant's tool_calls and role "tool" results
  messages    Anthropic Messages: tool_use / tool_result blocks, cache_control on the newest block
              (as Claude Code marks it; loomserve caches regardless)
  responses   Responses, stateless: the output items resent as input (Codex's store=false way)
  responses+prev  Responses with previous_response_id: only the tool output is sent

Cached tokens come from each response's usage (prompt_tokens_details.cached_tokens,
cache_read_input_tokens, input_tokens_details.cached_tokens). Two rates from turn 2 on:
  hit    cached / prompt tokens (new tool output is uncached by nature)
  reuse  cached / (previous prompt + previous completion): the share of the history the server
         could reuse; below ~95% means the history did not re-render byte-stable (the assistant
         turn re-renders differently from what was generated, or an earlier part moved).
Each conversation opens with its own system text, so no API hits another's blocks.

    python benchmarks/agent_api_cache.py [--turns 8] [--url URL] [--apis chat ...]
    python benchmarks/agent_api_cache.py --tiny --file-funcs 4 --max-tokens 160  # 4K context
    python benchmarks/agent_api_cache.py --context-funcs 100 --file-funcs 3  # agent proportions

Writes benchmarks/results/agent_api_cache[-tiny].json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    REPO_ROOT,
    ServerProcess,
    format_table,
    free_port,
    host_info,
    write_json,
)

TINY_AGENT = os.path.join(REPO_ROOT, "tests", "fixtures", "tiny-agent")
FILES = ["src/app.py", "src/db.py", "src/auth.py", "src/api.py", "tests/test_app.py",
         "README.md", "setup.cfg", "src/util.py"]
PARAMS = {"type": "object", "properties": {"path": {"type": "string", "enum": FILES}},
          "required": ["path"], "additionalProperties": False}
DESCRIPTION = "Read a file of the repository and return its text."
TASK = "Find where the request handlers validate their input. Read the files one by one."
MAX_TOKENS = 64  # one call takes ~40 tokens: a cut call could not re-render as generated


FILE_FUNCS = 14  # functions per fake file: ~550 SmolLM2 tokens
CONTEXT_FUNCS = 0  # functions of repository context in the system text (~40 tokens each)


def fake_file(path: str, turn: int) -> str:
    """A few hundred tokens of plausible source text, fixed for (path, turn)."""
    lines = [f"# {path}"]
    for i in range(FILE_FUNCS):
        lines.append(f"def handler_{turn}_{i}(request, db):\n"
                     f"    data = request.json()\n    return db.save('{path}', data, {i * 7 + turn})")
    return "\n".join(lines)


def system_text(api: str) -> str:
    # a distinct first line per conversation: no conversation hits another's cached blocks;
    # --context-funcs adds the long, stable context agents resend (instructions, loaded files)
    head = f"Session {api}-{uuid.uuid4().hex[:8]}. You are a coding agent with a file reader."
    if not CONTEXT_FUNCS:
        return head
    context = "\n".join(f"def context_{i}(request, db):\n    return db.load('ctx', {i})"
                        for i in range(CONTEXT_FUNCS))
    return f"{head}\nRepository context:\n{context}"


def row(turn: int, prompt: int, cached: int, completion: int, prev: tuple[int, int] | None,
        finish: str | None):
    reusable = sum(prev) if prev else 0
    return {"turn": turn, "prompt_tokens": prompt, "cached_tokens": cached,
            "completion_tokens": completion, "reusable": reusable, "finish": finish}


def run_chat(url: str, model: str, turns: int, rows: list[dict]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="x")
    tools = [{"type": "function", "function": {"name": "read_file", "description": DESCRIPTION,
                                                "parameters": PARAMS}}]
    messages = [{"role": "system", "content": system_text("chat")},
                {"role": "user", "content": TASK}]
    prev = None
    for turn in range(1, turns + 1):
        r = client.chat.completions.create(model=model, messages=messages, tools=tools,
                                           tool_choice="required", parallel_tool_calls=False,
                                           temperature=0, max_tokens=MAX_TOKENS)
        u = r.usage
        cached = (u.prompt_tokens_details.cached_tokens or 0) if u.prompt_tokens_details else 0
        rows.append(row(turn, u.prompt_tokens, cached, u.completion_tokens, prev,
                        r.choices[0].finish_reason))
        prev = (u.prompt_tokens, u.completion_tokens)
        msg = r.choices[0].message
        assert msg.tool_calls, f"turn {turn}: no tool call: {msg}"
        messages.append(msg.model_dump(exclude_none=True))  # as the client got it
        for call in msg.tool_calls:
            path = json.loads(call.function.arguments)["path"]
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": fake_file(path, turn)})


def run_messages(url: str, model: str, turns: int, rows: list[dict]) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="x")
    tools = [{"name": "read_file", "description": DESCRIPTION, "input_schema": PARAMS}]
    system = [{"type": "text", "text": system_text("messages"),
               "cache_control": {"type": "ephemeral"}}]
    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": TASK}]}]
    prev = None
    for turn in range(1, turns + 1):
        _mark_newest(messages)
        r = client.messages.create(model=model, system=system, messages=messages, tools=tools,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   max_tokens=MAX_TOKENS,
                                   extra_body={"temperature": 0})  # no longer a client arg
        u = r.usage
        cached = u.cache_read_input_tokens or 0
        # Anthropic's input_tokens counts only what was not read from (or written to) the cache
        prompt = u.input_tokens + cached + (u.cache_creation_input_tokens or 0)
        rows.append(row(turn, prompt, cached, u.output_tokens, prev, r.stop_reason))
        prev = (prompt, u.output_tokens)
        calls = [b for b in r.content if b.type == "tool_use"]
        assert calls, f"turn {turn}: no tool_use: {r.content}"
        messages.append({"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in r.content]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": fake_file(b.input["path"], turn)}
            for b in calls]})


def _mark_newest(messages: list[dict]) -> None:
    """cache_control on the newest user block only, as Claude Code moves it each turn."""
    for m in messages:
        if isinstance(m["content"], list):
            for block in m["content"]:
                block.pop("cache_control", None)
    messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}


def run_responses(url: str, model: str, turns: int, rows: list[dict], *, chained: bool) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="x")
    tools = [{"type": "function", "name": "read_file", "description": DESCRIPTION,
              "parameters": PARAMS, "strict": True}]
    instructions = system_text("responses+prev" if chained else "responses")
    history: list[dict] = [{"role": "user", "content": TASK}]
    new_input, prev_id = list(history), None
    prev = None
    for turn in range(1, turns + 1):
        extra = {"previous_response_id": prev_id} if chained and prev_id else {}
        r = client.responses.create(model=model, instructions=instructions,
                                    input=new_input if chained else history, tools=tools,
                                    tool_choice="required", parallel_tool_calls=False,
                                    temperature=0,
                                    max_output_tokens=MAX_TOKENS, store=chained, **extra)
        u = r.usage
        cached = (u.input_tokens_details.cached_tokens or 0) if u.input_tokens_details else 0
        rows.append(row(turn, u.input_tokens, cached, u.output_tokens, prev,
                        r.incomplete_details.reason if r.incomplete_details else r.status))
        prev, prev_id = (u.input_tokens, u.output_tokens), r.id
        calls = [it for it in r.output if it.type == "function_call"]
        assert calls, f"turn {turn}: no function_call: {r.output}"
        outputs = [{"type": "function_call_output", "call_id": c.call_id,
                    "output": fake_file(json.loads(c.arguments)["path"], turn)} for c in calls]
        history += [it.model_dump(exclude_none=True) for it in r.output] + outputs
        new_input = outputs


APIS = {"chat": run_chat, "messages": run_messages,
        "responses": lambda *a: run_responses(*a, chained=False),
        "responses+prev": lambda *a: run_responses(*a, chained=True)}


def summarize(rows: list[dict]) -> dict:
    later = rows[1:]
    prompt = sum(r["prompt_tokens"] for r in later)
    cached = sum(r["cached_tokens"] for r in later)
    reusable = sum(r["reusable"] for r in later)
    return {"hit": cached / prompt if prompt else float("nan"),
            "reuse": cached / reusable if reusable else float("nan"),
            "prompt_tokens": prompt, "cached_tokens": cached}


def report(results: dict) -> str:
    out = []
    for api, res in results.items():
        if "error" in res:
            out.append(f"{api}: FAILED after {len(res['turns'])} turns: {res['error']}")
            if len(res["turns"]) < 2:
                continue
        rows = [[r["turn"], r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"],
                 f"{r['cached_tokens'] / r['prompt_tokens']:.1%}",
                 f"{r['cached_tokens'] / r['reusable']:.1%}" if r["reusable"] else "-",
                 r["finish"]]
                for r in res["turns"]]
        s = res["summary"]
        out.append(f"{api}: turns 2+: hit {s['hit']:.1%}, reuse {s['reuse']:.1%} "
                   f"({s['cached_tokens']} / {s['prompt_tokens']} prompt tokens)")
        out.append(format_table(["turn", "prompt", "cached", "completion", "hit", "reuse",
                                 "finish"], rows))
    return "\n".join(out)


def serve_argv(args, port: int) -> list[str]:
    argv = [sys.executable, "-m", "loomserve", "serve"]
    if args.tiny:
        argv += [TINY_AGENT]
    elif args.model:
        argv += [args.model]
    argv += ["--port", str(port), "--dtype", "float32", "--log-level", "warning"]
    if args.kv_cache_memory:
        argv += ["--kv-cache-memory", args.kv_cache_memory]
    return argv


def run_all(url: str, apis: list[str], turns: int) -> dict:
    import httpx

    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    results = {}
    for api in apis:
        rows: list[dict] = []  # filled turn by turn: a failure keeps the turns before it
        try:
            APIS[api](url, model, turns, rows)
            results[api] = {"turns": rows, "summary": summarize(rows)}
        except Exception as e:  # one API failing still reports the others
            results[api] = {"error": f"{type(e).__name__}: {e}", "turns": rows,
                            "summary": summarize(rows)}
        print(f"[{api}] done", file=sys.stderr, flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="serve tests/fixtures/tiny-agent")
    p.add_argument("--model", help="model to serve (default: the built-in SmolLM2-135M)")
    p.add_argument("--url", help="use this running server instead of starting one")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--apis", nargs="+", choices=list(APIS), default=list(APIS))
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--file-funcs", type=int, default=FILE_FUNCS,
                   help="size of each tool result, in functions of fake source")
    p.add_argument("--context-funcs", type=int, default=CONTEXT_FUNCS,
                   help="long stable context in the system text, in functions of fake source "
                        "(agents resend ~96%% of each prompt; 0: none)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="per turn")
    args = p.parse_args()
    globals().update(FILE_FUNCS=args.file_funcs, MAX_TOKENS=args.max_tokens,
                     CONTEXT_FUNCS=args.context_funcs)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if args.url:
        results = run_all(args.url, args.apis, args.turns)
    else:
        env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        port = free_port()
        with ServerProcess(serve_argv(args, port), port, name="loomserve", env=env) as srv:
            results = run_all(srv.base_url, args.apis, args.turns)
            if any("error" in r for r in results.values()):
                print(srv.tail(), file=sys.stderr)
    print(report(results))
    name = "agent_api_cache-tiny.json" if args.tiny else "agent_api_cache.json"
    path = write_json(name, {"date": started, "host": host_info(), "argv": sys.argv,
                             "turns": args.turns, "results": results})
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
