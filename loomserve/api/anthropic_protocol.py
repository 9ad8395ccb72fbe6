"""Request and response bodies of the Anthropic Messages API, and a request's conversion to the
neutral chat request (loomserve.api.chat).

Invariants: every input the server cannot honour is a 400 whose message names the field
(`messages.2.content.0: ...`), except server tools (a `type` other than `custom`), which are
dropped and reported in `ignored` (the route names them in an `x-loomserve-warning` header,
as the Responses API does) so that agents which offer them (web search) keep working.
Unknown top-level fields and cache_control are ignored (prefix caching is automatic).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from loomserve.api.chat.frontend import ChatRequest
from loomserve.api.chat.validate import ChatInputError, check_schema
from loomserve.api.errors import bad_request
from loomserve.sampling_params import SamplingParams

# Anthropic's rule for tool names.
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentBlock(_Lenient):
    """Any content block; `type` says which fields matter, checked by the conversion."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: Union[str, list["ContentBlock"], None] = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None


class InputMessage(_Lenient):
    role: str
    content: Union[str, list[ContentBlock]]


class Tool(_Lenient):
    name: str
    description: str | None = None
    input_schema: Any = None
    type: str | None = None  # None / "custom": a client tool; anything else: a server tool


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Lenient):
    type: str  # enabled | adaptive | disabled
    budget_tokens: int | None = None


class Metadata(_Lenient):
    user_id: str | None = None


class OutputFormat(_Lenient):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Lenient):
    format: OutputFormat | None = None


class CountTokensRequest(_Lenient):
    """POST /v1/messages/count_tokens: what shapes the prompt, no sampling fields."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: Union[str, list[ContentBlock], None] = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    def to_chat_request(self) -> tuple[ChatRequest, list[str]]:
        """The neutral request, and the names of the server tools it dropped."""
        tools, ignored = _convert_tools(self.tools or [])
        choice = _convert_tool_choice(self.tool_choice, tools)
        req = ChatRequest(messages=_Messages().convert(self.system, self.messages),
                          tools=tools or None, tool_choice=choice,
                          response_format=self._response_format(),
                          template_kwargs=self._template_kwargs(),
                          parallel_tool_calls=self.parallel_tool_calls)
        return req, ignored

    @property
    def parallel_tool_calls(self) -> bool:
        return not (self.tool_choice and self.tool_choice.disable_parallel_tool_use)

    def _template_kwargs(self) -> dict:
        # Templates that can switch thinking read `enable_thinking` (Qwen3, GLM, ...); others
        # ignore the variable. Without a thinking field the template's own default holds.
        # Every type but "disabled" (enabled, adaptive, newer ones) asks for thinking: a type
        # this server does not know yet must not fail an agent's whole request.
        if self.thinking is None:
            return {}
        return {"enable_thinking": self.thinking.type != "disabled"}

    def _response_format(self) -> dict | None:
        fmt = self.output_config.format if self.output_config else None
        if fmt is None:
            return None
        return {"type": "json_schema",
                "json_schema": {"name": "output", "schema": fmt.schema_, "strict": True}}


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    # prefill/decode disaggregation (vLLM's name): a prefill or decode leg
    kv_transfer_params: dict[str, Any] | None = None
    priority: int = 0  # extension (vLLM's name): scheduling priority, lower is served first

    def to_sampling_params(self) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                max_tokens=self.max_tokens, stop=list(self.stop_sequences or []))
        except ValueError as e:
            raise bad_request(str(e)) from e


# Conversion --------------------------------------------------------------------------------

def _convert_tools(tools: list[Tool]) -> tuple[list[dict], list[str]]:
    out, ignored = [], []
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            ignored.append(f"{tool.name} ({tool.type})")
            continue
        if not TOOL_NAME.match(tool.name):
            raise bad_request(f"tools.{i}.name: {tool.name!r} must match "
                              f"{TOOL_NAME.pattern}.")
        schema = tool.input_schema
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise bad_request(f"tools.{i}.input_schema: must be a JSON Schema object with "
                              f"\"type\": \"object\", got {json.dumps(schema)[:200]}.")
        try:
            check_schema(schema, f"tools.{i}.input_schema")
        except ChatInputError as e:
            raise bad_request(e.message) from e
        function = {"name": tool.name, "parameters": schema}
        if tool.description is not None:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise bad_request("tools: tool names must be unique.")
    return out, ignored


def _convert_tool_choice(choice: ToolChoice | None, tools: list[dict]) -> Any:
    if choice is None:
        return "auto"
    if choice.type in ("any", "tool") and not tools:
        raise bad_request(f"tool_choice: type {choice.type!r} needs at least one tool in "
                          "`tools`.")
    if choice.type == "tool":
        if choice.name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice.name: {choice.name!r} is not one of the tools.")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


class _Messages:
    """Anthropic messages -> neutral messages. Tool results become `tool` messages, in the
    order of their blocks; each must answer a tool_use of an earlier assistant turn."""

    def __init__(self) -> None:
        self.out: list[dict] = []
        self.tool_names: dict[str, str] = {}  # tool_use id -> tool name

    def convert(self, system, messages: list[InputMessage]) -> list[dict]:
        if system:
            text = system if isinstance(system, str) else self._texts(system, "system")
            self.out.append({"role": "system", "content": text})
        for i, msg in enumerate(messages):
            if msg.role == "user":
                self._user(msg.content, f"messages.{i}")
            elif msg.role == "assistant":
                self._assistant(msg.content, f"messages.{i}")
            elif msg.role == "system":
                # Claude Code sends system reminders mid-conversation (its beta
                # mid-conversation-system): a system turn where it stands.
                content = msg.content
                text = content if isinstance(content, str) else self._texts(
                    content, f"messages.{i}.content")
                self.out.append({"role": "system", "content": text})
            else:
                raise bad_request(f"messages.{i}.role: {msg.role!r} is not a valid role; "
                                  "expected 'user', 'assistant' or 'system'.")
        return self.out

    def _user(self, content, where: str) -> None:
        if isinstance(content, str):
            self.out.append({"role": "user", "content": content})
            return
        texts: list[str] = []
        for j, block in enumerate(content):
            at = f"{where}.content.{j}"
            if block.type == "text":
                texts.append(_text_of(block, at))
            elif block.type == "tool_result":
                if texts:  # text before a result stays before it
                    self.out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                self.out.append(self._tool_result(block, at))
            else:
                _unsupported(block, at)
        if texts or not content:
            self.out.append({"role": "user", "content": "\n".join(texts)})

    def _tool_result(self, block: ContentBlock, at: str) -> dict:
        if block.tool_use_id not in self.tool_names:
            raise bad_request(f"{at}.tool_use_id: {block.tool_use_id!r} does not answer a "
                              "tool_use block of an earlier assistant message.")
        content = block.content
        text = content if isinstance(content, str) else self._texts(content or [], at + ".content")
        if block.is_error:
            # The neutral shape has no error flag: the model reads it from the text.
            text = f"Error: {text}"
        return {"role": "tool", "tool_call_id": block.tool_use_id,
                "name": self.tool_names[block.tool_use_id], "content": text}

    def _assistant(self, content, where: str) -> None:
        msg: dict = {"role": "assistant", "content": ""}
        if isinstance(content, str):
            msg["content"] = content
            self.out.append(msg)
            return
        texts, thinking, calls = [], [], []
        for j, block in enumerate(content):
            at = f"{where}.content.{j}"
            if block.type == "text":
                texts.append(_text_of(block, at))
            elif block.type == "thinking":
                thinking.append(block.thinking or "")
            elif block.type == "redacted_thinking":
                continue  # encrypted by Anthropic: nothing a local model can read
            elif block.type == "tool_use":
                calls.append(self._tool_use(block, at))
            else:
                _unsupported(block, at)
        msg["content"] = "".join(texts)
        if thinking:
            msg["reasoning_content"] = "".join(thinking)
        if calls:
            msg["tool_calls"] = calls
        self.out.append(msg)

    def _tool_use(self, block: ContentBlock, at: str) -> dict:
        if not block.id or not block.name:
            raise bad_request(f"{at}: a tool_use block needs `id` and `name`.")
        if not isinstance(block.input, dict):
            raise bad_request(f"{at}.input: must be an object.")
        self.tool_names[block.id] = block.name
        return {"id": block.id, "type": "function",
                "function": {"name": block.name, "arguments": json.dumps(block.input)}}

    @staticmethod
    def _texts(blocks: list[ContentBlock], where: str) -> str:
        texts = []
        for j, block in enumerate(blocks):
            if block.type != "text":
                _unsupported(block, f"{where}.{j}")
            texts.append(_text_of(block, f"{where}.{j}"))
        return "\n".join(texts)


def _text_of(block: ContentBlock, at: str) -> str:
    if block.text is None:
        raise bad_request(f"{at}.text: a text block needs `text`.")
    return block.text


def _unsupported(block: ContentBlock, at: str):
    if block.type in ("image", "document"):
        raise bad_request(f"{at}: {block.type} content blocks are not supported: this server "
                          "serves text-only models.")
    raise bad_request(f"{at}: content blocks of type {block.type!r} are not supported here.")


# Responses ---------------------------------------------------------------------------------

class Usage(BaseModel):
    """Anthropic counts input_tokens without the cached ones: input_tokens +
    cache_read_input_tokens + cache_creation_input_tokens is the prompt's length. Extension:
    miss_causes, input_tokens by cause (loomserve.kv.miss_causes), absent when unknown."""

    model_config = ConfigDict(extra="allow")

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> "Usage":
        # Every prompt token is kept in the prefix cache, so none is billed as a cache write.
        return cls(input_tokens=prompt_tokens - cached_tokens, output_tokens=output_tokens,
                   cache_read_input_tokens=cached_tokens)


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage
