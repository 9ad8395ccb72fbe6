"""Messages + tools -> prompt text, through the model's own Jinja chat template.

A template that reads `tools` gets them as transformers passes them (`tools=[...]`, OpenAI's
function shape), and the history as is: assistant `tool_calls`, `tool` results with their
`tool_call_id` (and `name`), `reasoning_content` on assistant turns. Call arguments go in as
the client's JSON text where the template tests `arguments is string`, else as the parsed
object (json.loads keeps the key order, so the text is stable).

A template that does not read `tools` gets the documented fallback (Hermes style) instead of a
silent drop: the tool schemas and instructions to answer with <tool_call> JSON are appended to
the system message (one is added first when there is none), assistant tool calls are written
into the content in that format, and tool results become a user turn of
<tool_response>...</tool_response> blocks (consecutive results share one turn).

Invariant: rendering is a pure function of (messages, tools, kwargs), so a conversation's
history renders to the same bytes every turn, and the prefix cache can reuse it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jinja2 import meta

from loomserve.engine.tokenizer import compile_chat_template, template_environment

FALLBACK_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')

# Keys a client's template_kwargs may not override: the renderer owns them.
RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token",
                             "eos_token"})


def hermes_call_text(name: str, arguments: Any) -> str:
    """One call as the Hermes parser reads it (what the fallback writes into history)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    quoted = json.dumps(name, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {quoted}, "arguments": {args}}}\n</tool_call>'


class ChatRenderer:
    """One chat template, compiled once, and what it supports."""

    def __init__(self, template: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source = template
        self.template = compile_chat_template(template)
        self.bos_token, self.eos_token = bos_token, eos_token
        names = meta.find_undeclared_variables(template_environment().parse(template))
        self.supports_tools = "tools" in names
        self.arguments_as_string = re.search(r"arguments\s+is\s+string", template) is not None
        self.knows_developer = "developer" in template
        self.reads_thinking = re.search(r"[.'\"]thinking\b", template) is not None

    def render(self, messages: list[dict], tools: list[dict] | None,
               add_generation_prompt: bool = True, kwargs: dict | None = None) -> str:
        """Messages (neutral shape, already validated) -> prompt text. ValueError (bad input
        the template rejects) and jinja2 errors propagate for the caller to report."""
        fallback = not self.supports_tools and bool(tools or any(map(_uses_tools, messages)))
        # The fallback writes call arguments into the text: the client's text as given, so a
        # call renders the bytes the model generated (pretty-printed or not) and stays cached.
        msgs = [self._message(m, keep_arguments=fallback) for m in messages]
        tools = [template_tool(t) for t in tools] if tools else None
        if fallback:
            msgs, tools = fallback_messages(msgs, tools), None
        return self.template.render(
            **(kwargs or {}), messages=msgs, tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token)

    def _message(self, m: dict, keep_arguments: bool = False) -> dict:
        out = dict(m)
        if out["role"] == "developer" and not self.knows_developer:
            out["role"] = "system"  # most templates predate the developer role
        if out.get("tool_calls"):
            out["tool_calls"] = [self._call(c, keep_arguments) for c in out["tool_calls"]]
        if out.get("reasoning_content") and self.reads_thinking:
            out.setdefault("thinking", out["reasoning_content"])  # gpt-oss's name
        return out

    def _call(self, call: dict, keep_arguments: bool) -> dict:
        fn = call["function"]
        args = fn["arguments"]
        if not (self.arguments_as_string or keep_arguments) and isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        return {"id": call["id"], "type": "function",
                "function": {"name": fn["name"], "arguments": args}}


def template_tool(tool: dict) -> dict:
    """The tool as templates expect it: OpenAI's function shape without `strict` (a sampling
    option, not something models were trained to read)."""
    fn = tool["function"]
    out = {"name": fn["name"]}
    if fn.get("description") is not None:
        out["description"] = fn["description"]
    out["parameters"] = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "function", "function": out}


def _uses_tools(m: dict) -> bool:
    return m["role"] == "tool" or bool(m.get("tool_calls"))


def fallback_messages(msgs: list[dict], tools: list[dict] | None) -> list[dict]:
    """The Hermes-style rewrite for a template without tool support (see the module doc)."""
    out: list[dict] = []
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        block = FALLBACK_INSTRUCTIONS.format(tools=listing)
        if msgs and msgs[0]["role"] == "system":
            first = msgs[0]
            text = f"{first['content']}\n\n{block}" if first["content"] else block
            out.append({**first, "content": text})
            msgs = msgs[1:]
        else:
            out.append({"role": "system", "content": block})
    for m in msgs:
        if m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
        elif m.get("tool_calls"):
            calls = [hermes_call_text(c["function"]["name"], c["function"]["arguments"])
                     for c in m["tool_calls"]]
            content = "\n".join(([m["content"]] if m["content"] else []) + calls)
            rest = {k: v for k, v in m.items() if k != "tool_calls"}
            out.append({**rest, "content": content})
        else:
            out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    return out

