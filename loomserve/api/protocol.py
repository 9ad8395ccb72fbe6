"""Bodies shared by the server's APIs: usage counts and the model list.

The OpenAI request and response bodies are in openai_protocol.py, Anthropic's in
anthropic_protocol.py, the Responses API's in responses_protocol.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from loomserve.engine.output import RequestOutput


class Lenient(BaseModel):
    """A request body: unknown fields are ignored (clients send many vendor extras); the known
    ones a server cannot honour are rejected by name by the API's own checks."""

    model_config = ConfigDict(extra="ignore")


class PromptTokensDetails(BaseModel):
    """cached_tokens, and once known the extension miss_causes: the uncached prompt tokens
    by cause (loomserve.kv.miss_causes; absent, not null, when unknown)."""

    model_config = ConfigDict(extra="allow")

    cached_tokens: int = 0

    @classmethod
    def of(cls, out: RequestOutput) -> "PromptTokensDetails":
        if out.miss_causes is None:
            return cls(cached_tokens=out.num_cached_tokens)
        return cls(cached_tokens=out.num_cached_tokens, miss_causes=out.miss_causes)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, out: RequestOutput) -> "Usage":
        return cls.of_samples([out])

    @classmethod
    def of_samples(cls, outs: list[RequestOutput]) -> "Usage":
        """One prompt, n samples: the prompt counts once (its KV is shared), completions add
        up; cached tokens are the first sample's (the others reuse its blocks)."""
        prompt = len(outs[0].prompt_token_ids)
        completion = sum(len(o.token_ids) for o in outs)
        return cls(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails.of(outs[0]))


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "loomserve"
    root: str | None = None  # vLLM's: the weights the name serves (its folder)
    parent: str | None = None  # vLLM's: the base model of an adapter (none here)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
