"""Checks of a ChatRequest's messages, tools and tool_choice, before anything is rendered.

Every check raises ChatInputError (message, param), which each API turns into a 400 in its own
error shape. What passes is in the neutral shape render.py expects: content a string, tool
calls with string arguments holding a JSON object, tool results tied to an earlier call.
"""

from __future__ import annotations

import json
import re

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "contains", "if", "then", "else")


class ChatInputError(ValueError):
    """Bad chat input: a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def content_text(content, where: str) -> str:
    """A message's content as text: a string, a list of text parts, or None (-> "")."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "input_text", "output_text") or \
                    not isinstance(part.get("text"), str):
                raise ChatInputError(f"{where}.content[{i}]: only text parts are supported, "
                                     f"got type {kind!r}", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatInputError(f"{where}.content must be a string or a list of text parts", "messages")


def check_messages(messages: list[dict]) -> list[dict]:
    """Validated copies of the messages, content as text (see the module doc)."""
    if not isinstance(messages, list) or not messages:
        raise ChatInputError("messages must be a non-empty list", "messages")
    out, call_names = [], {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatInputError(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise ChatInputError(f"{where}: unknown role {role!r}; expected one of "
                                 f"{', '.join(ROLES)}", "messages")
        msg = {**m, "content": content_text(m.get("content"), where)}
        if role == "assistant":
            msg.pop("tool_calls", None)
            calls = [_check_call(c, f"{where}.tool_calls[{j}]")
                     for j, c in enumerate(m.get("tool_calls") or [])]
            if calls:
                msg["tool_calls"] = calls
                call_names.update((c["id"], c["function"]["name"]) for c in calls)
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            msg.pop("reasoning", None)
            if reasoning:
                if not isinstance(reasoning, str):
                    raise ChatInputError(f"{where}.reasoning_content must be a string", "messages")
                msg["reasoning_content"] = reasoning
        elif m.get("tool_calls"):
            raise ChatInputError(f"{where}: only assistant messages carry tool_calls", "messages")
        if role == "tool":
            call_id = m.get("tool_call_id")
            if call_id not in call_names:
                raise ChatInputError(f"{where}: tool_call_id {call_id!r} matches no tool call "
                                     "of an earlier assistant message", "messages")
            msg.setdefault("name", call_names[call_id])
        out.append(msg)
    return out


def _check_call(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ChatInputError(f"{where}: a tool call needs function.name", "messages")
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise ChatInputError(f"{where}: a tool call needs an id", "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, dict):  # some clients send the object itself
        args = json.dumps(args, ensure_ascii=False)
    if isinstance(args, str) and not args.strip():  # a call without arguments
        args = "{}"
    if not isinstance(args, str):
        raise ChatInputError(f"{where}.function.arguments must be JSON object text", "messages")
    try:
        parsed = json.loads(args)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ChatInputError(f"{where}.function.arguments is not a JSON object: {args[:80]!r}",
                             "messages")
    return {"id": call["id"], "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


def check_tools(tools) -> list[dict] | None:
    """Validated tools in the neutral shape; None when there are none."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatInputError("tools must be a list", "tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ChatInputError(f"{where}: only function tools are supported, got {kind!r}",
                                 "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ChatInputError(f"{where}: missing the function object", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ChatInputError(f"{where}.function.name must be 1-128 characters of letters, "
                                 f"digits, '_', '-', '.', ':'; got {name!r}", "tools")
        if name in seen:
            raise ChatInputError(f"{where}: duplicate tool name {name!r}", "tools")
        seen.add(name)
        _check_parameters(fn.get("parameters"), f"{where}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ChatInputError(f"{where}.function.description must be a string", "tools")
        out.append({"type": "function", "function": dict(fn)})
    return out or None


def _check_parameters(params, where: str) -> None:
    """A JSON Schema object for the arguments (or absent: no parameters)."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ChatInputError(f"{where} must be a JSON Schema object", "tools")
    if params.get("type", "object") != "object":
        raise ChatInputError(f"{where}: the arguments schema must have type 'object', got "
                             f"{params.get('type')!r}", "tools")
    check_schema(params, where)


def check_tool_choice(tool_choice, tools: list[dict] | None) -> tuple[str, str | None]:
    """(mode, name): ('auto' | 'none' | 'required', None), or ('named', the function's name,
    which must be one of the tools)."""
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise ChatInputError(f"tool_choice must be 'auto', 'none', 'required' or a named "
                                 f"function, got {tool_choice!r}", "tool_choice")
        if tool_choice == "required" and not tools:
            raise ChatInputError("tool_choice 'required' needs tools", "tool_choice")
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tool_choice.get("name")
        names = [t["function"]["name"] for t in tools or []]
        if name not in names:
            raise ChatInputError(f"tool_choice names the function {name!r}, which is not among "
                                 f"the tools ({', '.join(names) or 'none given'})", "tool_choice")
        return "named", name
    raise ChatInputError("tool_choice must be 'auto', 'none', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}", "tool_choice")


def check_schema(schema, where: str) -> None:
    """A light structural check of a JSON Schema (the engine's grammar compiler does the rest):
    objects or booleans all the way down, known type names."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ChatInputError(f"{where} must be a JSON Schema object", _param(where))
    types = schema.get("type")
    for t in types if isinstance(types, list) else [types] if types is not None else []:
        if t not in JSON_TYPES:
            raise ChatInputError(f"{where}.type: unknown JSON Schema type {t!r}", _param(where))
    for key in _SCHEMA_MAPS:
        sub = schema.get(key)
        if sub is not None:
            if not isinstance(sub, dict):
                raise ChatInputError(f"{where}.{key} must be an object", _param(where))
            for k, v in sub.items():
                check_schema(v, f"{where}.{key}.{k}")
    for key in _SCHEMA_LISTS:
        sub = schema.get(key)
        if sub is not None:
            if not isinstance(sub, list):
                raise ChatInputError(f"{where}.{key} must be a list", _param(where))
            for i, v in enumerate(sub):
                check_schema(v, f"{where}.{key}[{i}]")
    for key in _SCHEMA_ONES:
        if key in schema:
            check_schema(schema[key], f"{where}.{key}")
    required = schema.get("required")
    if required is not None and not (isinstance(required, list)
                                     and all(isinstance(r, str) for r in required)):
        raise ChatInputError(f"{where}.required must be a list of names", _param(where))


def _param(where: str) -> str:
    return where.split(".")[0].split("[")[0]
