"""Request and response bodies of the OpenAI-compatible API.

Requests are pydantic models, so wrong types and missing fields fail before the engine sees
them. Unknown fields are ignored (clients send many optional ones); the few that would change
the result and are not implemented (n > 1, echo, logprobs, penalties) are rejected by
`check_unsupported` instead of silently ignored.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from loomserve.entrypoints.output import RequestOutput
from loomserve.entrypoints.server.errors import bad_request
from loomserve.sampling_params import SamplingParams


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False


class TextPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: str
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def to_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"Content part type {part.type!r} is not supported; "
                                      "only text parts are.", param="messages")
                texts.append(part.text)
            content = "\n".join(texts)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class _SamplingRequest(_Lenient):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None  # None = the served model
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension; -1 or 0 disable it
    seed: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stop: Union[str, list[str], None] = None
    ignore_eos: bool = False  # extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None  # extension: isolates this request's prefix-cache entries
    user: str | None = None  # accepted, ignored
    logprobs: Any = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise bad_request("Only n=1 is supported.", param="n")
        if self.best_of not in (None, 1):
            raise bad_request("best_of is not supported.", param="best_of")
        if self.logprobs not in (None, False, 0):
            raise bad_request("logprobs are not supported.", param="logprobs")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise bad_request(f"{name} is not supported.", param=name)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        defaults = SamplingParams.__dataclass_fields__
        try:
            return SamplingParams(
                temperature=(defaults["temperature"].default if self.temperature is None
                              else self.temperature),
                top_p=defaults["top_p"].default if self.top_p is None else self.top_p,
                top_k=max(self.top_k or 0, 0),
                seed=self.seed,
                # None lets the engine generate up to the context limit, as OpenAI does.
                max_tokens=self.requested_max_tokens,
                stop=stop,
                ignore_eos=self.ignore_eos,
            )
        except ValueError as e:
            raise bad_request(str(e)) from e


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


PromptType = Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptType
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for this endpoint
    echo: bool = False
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise bad_request("echo is not supported.", param="echo")
        if self.suffix:
            raise bad_request("suffix is not supported.", param="suffix")

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


# Responses -------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, out: RequestOutput) -> "Usage":
        prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
        return cls(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A whole response or, when streaming, one chunk (OpenAI uses the same object)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "loomserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
