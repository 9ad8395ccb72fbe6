"""vLLM's utility routes: POST /tokenize, POST /detokenize, GET /version, in vLLM's shapes.

/tokenize takes a `prompt` (add_special_tokens default true) or chat `messages` (rendered by
the chat layer exactly as a chat completion's prompt, tools included; add_special_tokens
default false, as the template holds them) and answers {count, max_model_len, tokens,
token_strs}; /detokenize takes `tokens` and answers {prompt}. Errors are in the API's error
shape (an unknown model 404, bad input 400).
"""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import Any

from fastapi import FastAPI
from pydantic import Field, StrictInt

from loomserve.api.chat.frontend import ChatInputError, ChatRequest
from loomserve.api.errors import bad_request
from loomserve.api.handler import Handler
from loomserve.api.protocol import Lenient


class TokenizeRequest(Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool = False


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[StrictInt] = Field(default_factory=list)


def register_tokenize_routes(app: FastAPI, h: Handler) -> None:
    tokenizer = h.engine.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        h.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("Give exactly one of `prompt` and `messages`.", param="prompt")
        if body.messages is not None:
            ids = await asyncio.to_thread(_chat_ids, h, body)
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tokenizer.encode(body.prompt, add_special_tokens=special)
        return {"count": len(ids), "max_model_len": h.engine.max_model_len, "tokens": ids,
                "token_strs": token_strs(tokenizer, ids) if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        h.check_model(body.model)
        vocab = getattr(h.engine.ready, "vocab_size", None)
        bad = [t for t in body.tokens if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise bad_request(f"Token ids out of the vocabulary: {bad[:8]}", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/version")
    async def version() -> dict:
        return {"version": package_version()}


def package_version() -> str:
    try:
        return metadata.version("loomserve")
    except metadata.PackageNotFoundError:  # run from a source tree never installed
        return "unknown"


def _chat_ids(h: Handler, body: TokenizeRequest) -> list[int]:
    """The chat prompt's ids as a chat completion renders them (the same template path)."""
    if not body.add_generation_prompt or body.continue_final_message:
        raise bad_request("Only add_generation_prompt true (and continue_final_message false) "
                          "is supported: the prompt a chat completion would run.",
                          param="add_generation_prompt")
    try:
        prepared = h.chat.prepare(ChatRequest(messages=body.messages, tools=body.tools,
                                              template_kwargs=body.chat_template_kwargs or {}))
    except ChatInputError as e:
        raise bad_request(e.message, param=e.param) from e
    ids = list(prepared.prompt_token_ids)
    if body.add_special_tokens:  # the tokenizer's own BOS, when asked for on top
        ids = h.engine.tokenizer.encode(prepared.prompt_text, add_special_tokens=True)
    return ids


def token_strs(tokenizer, ids: list[int]) -> list[str]:
    """Each id's token string (the vocabulary's spelling, as vLLM's token_strs)."""
    convert = getattr(getattr(tokenizer, "hf", None), "convert_ids_to_tokens", None)
    if convert is not None:
        return [str(s) for s in convert(ids)]
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
