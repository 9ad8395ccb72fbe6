"""OpenAI Responses request body, and its conversion to the neutral chat shapes.

The request is a pydantic model (wrong types fail before the engine sees them); unknown fields
are ignored, because agent clients (Codex) send many that do not change the output here
(include, service_tier, truncation, text.verbosity...). Input items are checked one by one
here instead of by a pydantic union, so that a bad item is a 400 naming `input[i].<field>`.

Conversion invariants: `instructions` becomes the first (system) message and is never carried
over by previous_response_id; a `reasoning` item's text goes to the next assistant message's
reasoning_content; consecutive assistant output (message, function_call items) folds into one
assistant message with tool_calls, as Chat Completions would carry it; a function_call_output
must answer a call_id seen earlier in the conversation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from loomserve.api.errors import bad_request
from loomserve.sampling_params import SamplingParams

ROLES = ("user", "system", "developer", "assistant")
TEXT_PART_TYPES = ("input_text", "output_text", "text", "refusal")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextConfig(_Lenient):
    format: dict[str, Any] | None = None


class ReasoningConfig(_Lenient):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Lenient):
    model: str | None = None  # None = the served model
    input: Union[str, list[dict[str, Any]]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any]] = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool | None = True
    priority: int = 0  # extension (vLLM's name): scheduling priority, lower is served first
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool = False
    include: list[str] | None = None  # accepted; encrypted reasoning is never produced
    # Extensions (not in OpenAI's API), as on the other routes.
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    ignore_eos: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # prefill/decode disaggregation (vLLM's name): a prefill or decode leg
    kv_transfer_params: dict[str, Any] | None = None

    def input_items(self) -> list[dict]:
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return list(self.input)

    def to_sampling_params(self) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=max(self.top_k or 0, 0), seed=self.seed, ignore_eos=self.ignore_eos,
                # None lets the engine generate up to the context limit, as OpenAI does.
                max_tokens=self.max_output_tokens)
        except ValueError as e:
            raise bad_request(str(e)) from e

    def template_kwargs(self) -> dict:
        """reasoning.effort reaches the chat template as `reasoning_effort` (gpt-oss reads
        it); effort "none" / "minimal" also sets `enable_thinking=False` (Qwen3-style
        templates). chat_template_kwargs (extension) is applied last."""
        kwargs: dict = {}
        effort = self.reasoning.effort if self.reasoning else None
        if effort:
            kwargs["reasoning_effort"] = effort
            if effort in ("none", "minimal"):
                kwargs["enable_thinking"] = False
        kwargs.update(self.chat_template_kwargs or {})
        return kwargs


# tools, tool_choice, text.format --------------------------------------------------------------

@dataclass
class ToolSet:
    tools: list[dict] | None  # function tools in the neutral shape
    ignored: list[str]  # what was dropped, for the warning header
    namespace_of: dict[str, str]  # function name -> the namespace tool it came from


def convert_tools(tools: list[dict] | None) -> ToolSet:
    """Function tools, flattened out of namespace tools (Codex groups its sub-agent tools in
    one): the model sees plain names, and a call of a namespaced one names its namespace in
    the output item. A name already taken is dropped (first wins), as are other tool types."""
    out, ignored, namespace_of = [], [], {}
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind == "namespace" and isinstance(tool.get("tools"), list):
            inner = [(f"tools[{i}].tools[{j}]", t, str(tool.get("name")))
                     for j, t in enumerate(tool["tools"])]
        else:
            inner = [(f"tools[{i}]", tool, None)]
        for where, t, namespace in inner:
            if not isinstance(t, dict) or t.get("type") != "function":
                ignored.append(str(t.get("type") if isinstance(t, dict) else t))
                continue
            function = _function(t, where)
            if any(f["function"]["name"] == function["name"] for f in out):
                ignored.append(f"{function['name']} (duplicate name)")
                continue
            out.append({"type": "function", "function": function})
            if namespace is not None:
                namespace_of[function["name"]] = namespace
    return ToolSet(out or None, ignored, namespace_of)


def _function(tool: dict, where: str) -> dict:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.name: a function tool needs a name.", param=f"{where}.name")
    params = tool.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"{where}.parameters must be a JSON Schema object.",
                          param=f"{where}.parameters")
    function = {"name": name, "parameters": params or {"type": "object", "properties": {}}}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    if tool.get("strict") is not None:
        function["strict"] = bool(tool["strict"])
    return function


def convert_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request(f"tool_choice must be auto, none, required or a function, got "
                              f"{choice!r}.", param="tool_choice")
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice: only {\"type\": \"function\", \"name\": ...} is supported "
                      "besides auto / none / required.", param="tool_choice")


def convert_text_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text else None
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("text.format.schema must be a JSON Schema object.",
                              param="text.format.schema")
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name") or "response", "schema": schema,
            "strict": bool(fmt.get("strict", False))}}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got "
                      f"{fmt.get('type')!r}.", param="text.format.type")


# input items -> neutral messages ------------------------------------------------------------

def to_messages(items: list[dict], instructions: str | None) -> list[dict]:
    """The conversation as neutral chat messages (see loomserve.api.chat)."""
    conv = _Conversation()
    if instructions:
        conv.messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object.", param=f"input[{i}]")
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in ITEM_TYPES:
            raise bad_request(f"input[{i}].type {kind!r} is not supported; supported: "
                              f"{', '.join(ITEM_TYPES)}.", param=f"input[{i}].type")
        getattr(conv, f"on_{kind}")(item, f"input[{i}]")
    return conv.messages


class _Conversation:
    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.calls: dict[str, str] = {}  # call_id -> function name
        self.pending_reasoning = ""  # from reasoning items, for the next assistant message

    def _assistant(self) -> dict:
        """The assistant message output items add to: the last message if it is one still
        open (no tool result after it), else a new one."""
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self.pending_reasoning:
            last = {"role": "assistant", "content": ""}
            if self.pending_reasoning:
                last["reasoning_content"] = self.pending_reasoning
                self.pending_reasoning = ""
            self.messages.append(last)
        return last

    def on_message(self, item: dict, where: str) -> None:
        role = item.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}.",
                              param=f"{where}.role")
        text = _text_of(item.get("content"), f"{where}.content")
        if role == "assistant":
            msg = self._assistant()
            msg["content"] += text
        else:
            self.messages.append({"role": role, "content": text})

    def on_function_call(self, item: dict, where: str) -> None:
        call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
        for field, value in (("call_id", call_id), ("name", name), ("arguments", args)):
            if not isinstance(value, str) or (field != "arguments" and not value):
                raise bad_request(f"{where}.{field} must be a non-empty string.",
                                  param=f"{where}.{field}")
        msg = self._assistant()
        msg.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        self.calls[call_id] = name

    def on_function_call_output(self, item: dict, where: str) -> None:
        call_id = item.get("call_id")
        if call_id not in self.calls:
            raise bad_request(f"{where}.call_id {call_id!r} answers no function_call of this "
                              "conversation.", param=f"{where}.call_id")
        output = item.get("output")
        text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
        self.messages.append({"role": "tool", "tool_call_id": call_id,
                              "name": self.calls[call_id], "content": text})

    def on_reasoning(self, item: dict, where: str) -> None:
        # The full text (content) when the client kept it, else the summary; encrypted_content
        # is never produced here, so it is ignored.
        field = "content" if item.get("content") else "summary"
        self.pending_reasoning += _text_of(item.get(field), f"{where}.{field}")


def _text_of(content, where: str) -> str:
    """A message's text: a string, or text parts (input_text, output_text...) joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of parts.", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("reasoning_text", "summary_text"):
            kind = "text"
        if kind not in TEXT_PART_TYPES:
            raise bad_request(f"{where}[{j}].type {kind!r} is not supported; only text parts "
                              f"({', '.join(TEXT_PART_TYPES[:2])}) are.",
                              param=f"{where}[{j}].type")
        value = part.get("text", part.get("refusal"))
        if not isinstance(value, str):
            raise bad_request(f"{where}[{j}].text must be a string.", param=f"{where}[{j}].text")
        texts.append(value)
    return "\n".join(texts)

