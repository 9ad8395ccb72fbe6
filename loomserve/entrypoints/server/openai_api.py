"""OpenAI Chat Completions and Completions: POST /v1/chat/completions, POST /v1/completions."""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from loomserve.entrypoints.output import RequestOutput
from loomserve.entrypoints.server.errors import bad_request
from loomserve.entrypoints.server.handler import ClientGone, Handler, SSEResponse, new_id
from loomserve.entrypoints.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Usage,
)


def register_openai_routes(app: FastAPI, h: Handler) -> None:
    engine = h.engine

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        h.check_model(body.model)
        body.check_unsupported()
        messages = [m.to_template_dict() for m in body.messages]
        tok = engine.tokenizer

        def render() -> list[int]:
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False)

        try:
            prompt_ids = await asyncio.to_thread(render)
        except ValueError as e:
            raise bad_request(str(e), param="messages") from e
        request_id = new_id("chatcmpl")
        created = int(time.time())
        try:
            it, first, timer = await h.start(request, prompt_ids, body.to_sampling_params(), request_id,
                                            cache_salt=body.cache_salt)
        except ClientGone:
            return Response(status_code=499)

        if body.stream:
            include_usage = body.include_usage

            def chunk(choices, usage=None) -> ChatCompletionChunk:
                return ChatCompletionChunk(id=request_id, created=created, model=engine.model_name,
                                           choices=choices, usage=usage)

            def chunks(out: RequestOutput, is_first: bool):
                if is_first:
                    yield chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])
                if out.new_text:
                    yield chunk([ChatChunkChoice(delta=ChatDelta(content=out.new_text))])
                if out.finished:
                    yield chunk([ChatChunkChoice(delta=ChatDelta(),
                                                 finish_reason=out.finish_reason)])
                    if include_usage:
                        yield chunk([], Usage.of(out))

            return SSEResponse(h.stream(it, first, timer, request_id, chunks))

        try:
            out = await h.collect(request, it, first, timer, request_id)
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(ChatCompletion(
            id=request_id, created=created, model=engine.model_name, usage=Usage.of(out),
            choices=[ChatChoice(message=AssistantMessage(content=out.text),
                                finish_reason=out.finish_reason)]).model_dump())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        h.check_model(body.model)
        body.check_unsupported()
        prompt = body.single_prompt()
        request_id = new_id("cmpl")
        created = int(time.time())
        try:
            it, first, timer = await h.start(request, prompt, body.to_sampling_params(), request_id,
                                            cache_salt=body.cache_salt)
        except ClientGone:
            return Response(status_code=499)

        if body.stream:
            include_usage = body.include_usage

            def chunk(choices, usage=None) -> Completion:
                return Completion(id=request_id, created=created, model=engine.model_name,
                                  choices=choices, usage=usage)

            def chunks(out: RequestOutput, is_first: bool):
                if out.new_text or out.finished:
                    yield chunk([CompletionChoice(text=out.new_text,
                                                  finish_reason=out.finish_reason
                                                  if out.finished else None)])
                if out.finished and include_usage:
                    yield chunk([], Usage.of(out))

            return SSEResponse(h.stream(it, first, timer, request_id, chunks))

        try:
            out = await h.collect(request, it, first, timer, request_id)
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(Completion(
            id=request_id, created=created, model=engine.model_name, usage=Usage.of(out),
            choices=[CompletionChoice(text=out.text, finish_reason=out.finish_reason)]
        ).model_dump())

