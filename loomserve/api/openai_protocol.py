"""Request and response bodies of OpenAI Chat Completions and Completions.

Requests are pydantic models, so wrong types fail before the engine sees them. Every field of
OpenAI's request schemas is either honoured or, when set to something that would change the
result, rejected with a 400 naming it (`check_unsupported`); fields that change nothing here
(metadata, service_tier, safety_identifier, user) are accepted. Unknown fields are ignored.

`user` is OpenAI's end-user id, which spans many conversations, so it is not a session key;
`prompt_cache_key` is (it names the conversation's shared prefix): both Chat Completions and
Completions pass it to session_of.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, Field, StrictInt, StrictStr

from loomserve.api.chat.frontend import ChatRequest
from loomserve.api.errors import bad_request
from loomserve.api.protocol import Lenient, Usage
from loomserve.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_N = 16


class StreamOptions(Lenient):
    include_usage: bool = False


class _SamplingRequest(Lenient):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None  # None = the served model
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stop: Union[str, list[str], None] = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id: accepted, not a session (see the module doc)
    prompt_cache_key: str | None = None  # the session (prefix retention) this request is in
    # extensions (vLLM's names)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0 disable it
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    cache_salt: str | None = None  # isolates this request's prefix-cache entries
    priority: int = 0  # scheduling priority (vLLM's): lower is served first
    # prefill/decode disaggregation (vLLM's name): a prefill or decode leg
    kv_transfer_params: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        pass

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise bad_request("logit_bias keys must be token ids (integers as strings)",
                              param="logit_bias") from None

    def to_sampling_params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        defaults = SamplingParams.__dataclass_fields__
        try:
            return SamplingParams(
                temperature=(defaults["temperature"].default if self.temperature is None
                             else self.temperature),
                top_p=defaults["top_p"].default if self.top_p is None else self.top_p,
                top_k=max(self.top_k or 0, 0), seed=self.seed,
                # None lets the engine generate up to the context limit, as OpenAI does.
                max_tokens=self.requested_max_tokens, stop=stop, ignore_eos=self.ignore_eos,
                logprobs=self.requested_logprobs,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0,
                logit_bias=self._logit_bias(), min_tokens=self.min_tokens)
        except ValueError as e:  # SamplingParams' messages start with the field's name
            field = str(e).split(" ", 1)[0]
            raise bad_request(str(e), param=field if field in type(self).model_fields
                              else None) from e


def _reject(field: str, why: str = "is not supported by this server") -> None:
    raise bad_request(f"`{field}` {why}.", param=field)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension: enable_thinking, ...
    modalities: list[str] | None = None
    store: bool | None = None
    # accepted, change nothing here
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_retention: str | None = None
    # OpenAI fields this server does not implement: rejected when set
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    verbosity: Any = None

    def check_unsupported(self) -> None:
        for name in ("audio", "prediction", "web_search_options", "verbosity"):
            if getattr(self, name) is not None:
                _reject(name)
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                _reject(name, "(the legacy function calling) is not supported: use `tools` and "
                              "`tool_choice`")
        if self.modalities and set(self.modalities) != {"text"}:
            _reject("modalities", "other than ['text'] are not supported")
        if self.store:
            _reject("store", "is not supported: completions are not stored")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("`top_logprobs` needs `logprobs: true`.", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_chat_request(self) -> ChatRequest:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
            if self.reasoning_effort == "none":  # templates with a thinking switch (Qwen3)
                kwargs.setdefault("enable_thinking", False)
        return ChatRequest(messages=self.messages, tools=self.tools,
                           tool_choice=self.tool_choice or "auto",
                           response_format=self.response_format, template_kwargs=kwargs,
                           parallel_tool_calls=self.parallel_tool_calls)


PromptType = Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptType
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for this endpoint
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None

    def check_unsupported(self) -> None:
        if self.best_of not in (None, self.n):
            _reject("best_of", "other than n is not supported")
        if self.echo:
            _reject("echo")
        if self.suffix:
            _reject("suffix")

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise bad_request("The prompt is empty.", param="prompt")
        if all(isinstance(x, int) for x in p):
            return list(p)
        if len(p) != 1:
            raise bad_request("Batches of several prompts are not supported; send one prompt "
                              "per request.", param="prompt")
        return p[0]


# Responses --------------------------------------------------------------------------------

class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same text, for clients that read this name
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: dict | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(BaseModel):
    """One streamed chunk; choices are dicts ({index, delta, logprobs, finish_reason}) so a
    delta carries only the keys it sets."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[dict]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A whole response or, when streaming, one chunk (OpenAI uses the same object)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
