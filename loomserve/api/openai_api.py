"""OpenAI Chat Completions and Completions: POST /v1/chat/completions, POST /v1/completions.

Chat requests go through the chat front end (h.chat: validation, template with tools, grammar
for tool_choice / response_format); each of the n samples' text goes through its own output
parser (reasoning, tool calls); with parallel_tool_calls false, calls after the first are
dropped (a grammar, when there is one, already stops after one). Streams: per choice, a role
delta first, then content / reasoning / tool-call deltas as the parser reports them (a call's
first delta has its whole name), then a delta with its finish_reason; usage last when asked.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from loomserve.api.chat.frontend import ChatInputError
from loomserve.api.errors import bad_request
from loomserve.api.handler import (
    ClientGone,
    Handler,
    SSEResponse,
    new_id,
    with_transfer_params,
)
from loomserve.api.openai_output import (
    TokenTexts,
    all_entries,
    assistant_message,
    chat_logprobs,
    completion_logprobs,
    deltas,
    finish_reason,
    first_call_only,
    new_entries,
)
from loomserve.api.openai_protocol import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
)
from loomserve.api.protocol import Usage
from loomserve.api.samples import Batch, NullTimer, Samples, start_samples


def register_openai_routes(app: FastAPI, h: Handler) -> None:
    texts = TokenTexts(h.engine.tokenizer)

    # The samples' own timers record each one's metrics, so the Handler's is a NullTimer.
    def stream(samples: Samples, request_id: str, chunks) -> SSEResponse:
        return SSEResponse(h.stream(samples, samples.first_batch(), NullTimer(), request_id,
                                    chunks))

    async def collect(request: Request, samples: Samples, request_id: str) -> bool:
        """Wait for every sample to finish; False when the client went away first."""
        try:
            await h.collect(request, samples, samples.first_batch(), NullTimer(), request_id)
        except ClientGone:
            return False
        return True

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        h.check_model(body.model)
        body.check_unsupported()
        params = body.to_sampling_params()
        try:
            prepared = await asyncio.to_thread(h.chat.prepare, body.to_chat_request())
        except ChatInputError as e:
            raise bad_request(e.message, param=e.param) from e
        request_id, created = new_id("chatcmpl"), int(time.time())
        try:
            samples = await start_samples(
                h, request, prepared.prompt_token_ids, prepared.apply(params), request_id,
                body.n, session_id=body.prompt_cache_key, cache_salt=body.cache_salt,
                kv_transfer_params=body.kv_transfer_params, priority=body.priority,
                prompt_text=prepared.prompt_text)
        except ClientGone:
            return Response(status_code=499)
        parsers = [prepared.output_parser() for _ in range(body.n)]
        model = h.response_model(body.model)
        want_logprobs = params.logprobs is not None
        if body.stream:
            return stream(samples, request_id, ChatStream(
                request_id, created, model, parsers, texts, want_logprobs, body.include_usage,
                samples, body.parallel_tool_calls))
        if not await collect(request, samples, request_id):
            return Response(status_code=499)
        choices = []
        for i, (out, parser) in enumerate(zip(samples.latest, parsers)):
            parser.feed(out.text)
            parser.finish()
            result = parser.result()
            choices.append(ChatChoice(
                index=i, message=assistant_message(result, body.parallel_tool_calls),
                logprobs=chat_logprobs(texts, all_entries(out)) if want_logprobs else None,
                finish_reason=finish_reason(out.finish_reason, result)))
        return JSONResponse(with_transfer_params(ChatCompletion(
            id=request_id, created=created, model=model, choices=choices,
            usage=Usage.of_samples(samples.latest)).model_dump(), body.kv_transfer_params,
            samples.latest))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        h.check_model(body.model)
        body.check_unsupported()
        prompt = body.single_prompt()
        params = body.to_sampling_params()
        request_id, created = new_id("cmpl"), int(time.time())
        try:
            samples = await start_samples(h, request, prompt, params, request_id, body.n,
                                          session_id=body.prompt_cache_key,
                                          cache_salt=body.cache_salt,
                                          kv_transfer_params=body.kv_transfer_params,
                                          priority=body.priority)
        except ClientGone:
            return Response(status_code=499)
        model = h.response_model(body.model)
        want_logprobs = params.logprobs is not None
        if body.stream:
            return stream(samples, request_id, CompletionStream(
                request_id, created, model, texts, want_logprobs, body.include_usage, samples))
        if not await collect(request, samples, request_id):
            return Response(status_code=499)
        choices = [CompletionChoice(
            index=i, text=out.text, finish_reason=out.finish_reason,
            logprobs=completion_logprobs(texts, all_entries(out), 0)[0] if want_logprobs
            else None) for i, out in enumerate(samples.latest)]
        return JSONResponse(with_transfer_params(
            Completion(id=request_id, created=created, model=model, choices=choices,
                       usage=Usage.of_samples(samples.latest)).model_dump(),
            body.kv_transfer_params, samples.latest))


class ChatStream:
    """Batches of sample outputs -> chat.completion.chunk payloads (see the module doc)."""

    def __init__(self, request_id, created, model, parsers, texts, want_logprobs,
                 include_usage, samples: Samples, parallel: bool = True) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self.parsers, self.texts, self.want_logprobs = parsers, texts, want_logprobs
        self.include_usage, self.samples, self.parallel = include_usage, samples, parallel

    def chunk(self, choices: list[dict], usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=choices, usage=usage)

    def __call__(self, batch: Batch, is_first: bool):
        if is_first:
            for i in range(len(self.parsers)):
                yield self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}])
        for i, out in batch.parts:
            yield from self._sample(i, out)
        if batch.finished and self.include_usage:
            yield self.chunk([], Usage.of_samples(self.samples.latest))

    def _sample(self, i: int, out):
        parser = self.parsers[i]
        events = parser.feed(out.new_text) if out.new_text else []
        if out.finished:
            events += parser.finish()
        if not self.parallel:
            events = first_call_only(events)
        logprobs = (chat_logprobs(self.texts, new_entries(out))
                    if self.want_logprobs and out.new_token_ids else None)
        ds = deltas(events)
        if logprobs is not None and not ds:
            ds = [{}]  # the tokens' logprobs still go out, with an empty delta
        for delta in ds:
            yield self.chunk([{"index": i, "delta": delta, "logprobs": logprobs,
                               "finish_reason": None}])
            logprobs = None
        if out.finished:
            reason = finish_reason(out.finish_reason, parser.result())
            yield self.chunk([{"index": i, "delta": {}, "logprobs": None,
                               "finish_reason": reason}])


class CompletionStream:
    """Batches of sample outputs -> text_completion chunks."""

    def __init__(self, request_id, created, model, texts, want_logprobs, include_usage,
                 samples: Samples) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self.texts, self.want_logprobs = texts, want_logprobs
        self.include_usage, self.samples = include_usage, samples
        self.offsets = [0] * len(samples.latest)

    def chunk(self, choices, usage=None) -> Completion:
        return Completion(id=self.request_id, created=self.created, model=self.model,
                          choices=choices, usage=usage)

    def __call__(self, batch: Batch, is_first: bool):
        for i, out in batch.parts:
            if not (out.new_text or out.finished or (self.want_logprobs and out.new_token_ids)):
                continue
            logprobs = None
            if self.want_logprobs:
                logprobs, self.offsets[i] = completion_logprobs(self.texts, new_entries(out),
                                                                self.offsets[i])
            yield self.chunk([CompletionChoice(
                index=i, text=out.new_text, logprobs=logprobs,
                finish_reason=out.finish_reason if out.finished else None)])
        if batch.finished and self.include_usage:
            yield self.chunk([], Usage.of_samples(self.samples.latest))
