"""ChatFrontend: a chat request in the neutral shape -> prompt ids, grammar and output parser.

One per server (built from the engine's tokenizer and the serve options); every API (Chat
Completions, Messages, Responses) calls `prepare` in a worker thread, sets the returned
grammar on its SamplingParams (`PreparedChat.apply`) and reads the output through
`PreparedChat.output_parser()`.

Parser choice: --tool-call-parser / --reasoning-parser name one, `none` turns it off, `auto`
(default) detects it from the chat template's markers and the HF config's model_type. A template
without tool support uses the Hermes fallback (render.py) and so the Hermes parser.

Thinking and forced output: when the output must be only tool calls or JSON (tool_choice
required / named, response_format) and the template takes `enable_thinking`, it is rendered
with enable_thinking=False unless the client set it, so the grammar does not fight a reasoning
block the template opened.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import jinja2

from loomserve.api.chat.grammar import response_grammar, tool_grammar
from loomserve.api.chat.output_parser import ChatOutputParser
from loomserve.api.chat.render import RESERVED_KWARGS, ChatRenderer
from loomserve.api.chat.validate import (
    ChatInputError,
    check_messages,
    check_tool_choice,
    check_tools,
)
from loomserve.api.reasoning import detect_reasoning_parser, get_reasoning_parser
from loomserve.api.tool_parsers import detect_tool_parser, get_tool_parser
from loomserve.sampling_params import SamplingParams, StructuredOutputs

__all__ = ["ChatFrontend", "ChatInputError", "ChatRequest", "PreparedChat"]


@dataclass
class ChatRequest:
    """A chat turn in the neutral shape (chat/__init__.py)."""

    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: str | dict = "auto"
    response_format: dict | None = None
    template_kwargs: dict = field(default_factory=dict)
    parallel_tool_calls: bool = True


@dataclass
class PreparedChat:
    prompt_token_ids: list[int]
    prompt_text: str
    structured: StructuredOutputs | None
    skip_special_tokens: bool
    tool_parser_cls: type | None = None  # None: tool calls are not parsed (no tools, "none")
    tools: list[dict] | None = None
    reasoning_parser_cls: type | None = None
    starts_in_reasoning: bool = False

    def apply(self, params: SamplingParams) -> SamplingParams:
        """params with this turn's grammar and special-token handling (a copy)."""
        return replace(params, structured=self.structured,
                       skip_special_tokens=params.skip_special_tokens and self.skip_special_tokens)

    def output_parser(self) -> ChatOutputParser:
        """A fresh parser for one sample of this turn's output."""
        tool = self.tool_parser_cls(self.tools) if self.tool_parser_cls else None
        reasoning = (self.reasoning_parser_cls(self.starts_in_reasoning)
                     if self.reasoning_parser_cls else None)
        return ChatOutputParser(tool, reasoning)


class ChatFrontend:
    def __init__(self, tokenizer, tool_parser: str = "auto", reasoning_parser: str = "auto",
                 model_type: str | None = None, chat_template: str | None = None) -> None:
        """chat_template: a template's text overriding the model's (--chat-template).
        ValueError for an unknown parser name."""
        self.tokenizer = tokenizer
        template = chat_template or tokenizer.chat_template
        hf = tokenizer.hf
        self.renderer = (ChatRenderer(template, hf.bos_token or "", hf.eos_token or "")
                         if template else None)
        self.hermes_cls = get_tool_parser("hermes")
        self.tool_parser_cls = self._tool_parser(tool_parser, template, model_type)
        if reasoning_parser == "auto":
            reasoning_parser = detect_reasoning_parser(template, model_type) or "none"
        self.reasoning_parser_cls = (None if reasoning_parser == "none"
                                     else get_reasoning_parser(reasoning_parser))

    def _tool_parser(self, name: str, template: str | None, model_type: str | None):
        if name == "none":
            return None
        if name == "auto":
            if self.renderer is not None and not self.renderer.supports_tools:
                return self.hermes_cls  # the fallback writes Hermes calls
            name = detect_tool_parser(template, model_type)
        return get_tool_parser(name)

    @property
    def tool_parser_name(self) -> str:
        return self.tool_parser_cls.name if self.tool_parser_cls else "none"

    @property
    def reasoning_parser_name(self) -> str:
        return self.reasoning_parser_cls.name if self.reasoning_parser_cls else "none"

    def prepare(self, req: ChatRequest) -> PreparedChat:
        """Validate, pick the grammar, render and tokenize (sync: run it in a thread).
        ChatInputError on bad input."""
        messages = check_messages(req.messages)
        tools = check_tools(req.tools)
        mode, name = check_tool_choice(req.tool_choice, tools)
        structured, parser_cls = tool_grammar(tools or [], mode, name, req.parallel_tool_calls,
                                              self.tool_parser_cls, self.hermes_cls)
        text_format = response_grammar(req.response_format)
        forces_calls = mode in ("required", "named")
        if text_format is not None and not forces_calls:
            structured = text_format  # the text must be JSON: no room for calls
        kwargs = self._kwargs(req.template_kwargs, forced=structured is not None
                              and (forces_calls or text_format is not None))
        text = self._render(messages, tools, kwargs)
        reasoning = self.reasoning_parser_cls
        needs_special = any(getattr(c, "needs_special_tokens", False)
                            for c in (parser_cls, reasoning) if c is not None)
        return PreparedChat(
            prompt_token_ids=self.tokenizer.encode(text, add_special_tokens=False),
            prompt_text=text, structured=structured, skip_special_tokens=not needs_special,
            tool_parser_cls=parser_cls, tools=tools, reasoning_parser_cls=reasoning,
            starts_in_reasoning=bool(reasoning and reasoning.prompt_opens_reasoning(text)))

    def count_tokens(self, req: ChatRequest) -> int:
        """Prompt tokens of the request as prepare() would render it (no grammar built)."""
        messages, tools = check_messages(req.messages), check_tools(req.tools)
        text = self._render(messages, tools, self._kwargs(req.template_kwargs, forced=False))
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _kwargs(self, template_kwargs: dict | None, forced: bool) -> dict:
        kwargs = dict(template_kwargs or {})
        bad = RESERVED_KWARGS.intersection(kwargs)
        if bad:
            raise ChatInputError(f"chat_template_kwargs may not set {', '.join(sorted(bad))}",
                                 "chat_template_kwargs")
        if forced and self.renderer is not None and "enable_thinking" in self.renderer.source:
            kwargs.setdefault("enable_thinking", False)
        return kwargs

    def _render(self, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> str:
        if self.renderer is None:
            raise ChatInputError("this model has no chat template: serve it with --chat-template "
                                 "PATH, or use the completions API", "messages")
        try:
            return self.renderer.render(messages, tools, True, kwargs)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise ChatInputError(f"the chat template rejected the messages: {e}",
                                 "messages") from e
