"""OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request becomes a neutral ChatRequest (responses_protocol.py), runs through the chat layer
(h.chat) and the engine; the chat output parser's events become output items through one
OutputBuilder, used by both the streaming and the non-streaming path, so both give the same
output for the same tokens. Responses are kept in a bounded in-memory store (response_store.py)
unless the request says `store: false`; `previous_response_id` continues a stored one.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import re
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from loomserve.api.chat.events import (
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallStart,
)
from loomserve.api.chat.frontend import ChatInputError, ChatRequest, PreparedChat
from loomserve.api.errors import APIError, bad_request
from loomserve.api.handler import (
    WARNING_HEADER,
    ClientGone,
    Handler,
    SSEResponse,
    sse_event,
    with_transfer_params,
)
from loomserve.api.response_store import ResponseStore, StoredResponse
from loomserve.api.responses_protocol import (
    ResponsesRequest,
    convert_text_format,
    convert_tool_choice,
    convert_tools,
    to_messages,
)
from loomserve.engine.output import RequestOutput
from loomserve.sampling_params import SamplingParams

MAX_WARNING = 1000  # characters of the warning header


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """The chat parser's events -> Responses output items, and the stream events that build
    them. Invariants: an item is open (receiving deltas) until the next item opens or close();
    a message item opens at the first non-whitespace text (whitespace around tool calls makes
    no empty message); with parallel_tool_calls false, calls after the first are dropped."""

    def __init__(self, parallel_tool_calls: bool = True,
                 namespace_of: dict[str, str] | None = None) -> None:
        self.items: list[dict] = []
        self._namespace_of = namespace_of or {}
        self._open: dict | None = None
        self._pending_ws = ""
        self._calls: dict[int, dict] = {}  # the parser's call index -> function_call item
        self._parallel = parallel_tool_calls

    @property
    def reasoning(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")

    def feed(self, events) -> list[dict]:
        out: list[dict] = []
        for ev in events:
            if isinstance(ev, ReasoningDelta) and ev.text:
                self._reasoning_delta(ev.text, out)
            elif isinstance(ev, TextDelta) and ev.text:
                self._text_delta(ev.text, out)
            elif isinstance(ev, ToolCallStart) and (self._parallel or ev.index == 0):
                self._close(out, "completed")
                self._pending_ws = ""
                call = {"type": "function_call", "id": _id("fc"), "call_id": ev.id,
                        "name": ev.name, "arguments": "", "status": "in_progress"}
                if ev.name in self._namespace_of:
                    call["namespace"] = self._namespace_of[ev.name]
                self._calls[ev.index] = self._add(out, call)
            elif isinstance(ev, ToolCallArgs) and ev.index in self._calls and ev.text:
                item = self._calls[ev.index]
                item["arguments"] += ev.text
                out.append(self._ref("response.function_call_arguments.delta", item,
                                     delta=ev.text))
        return out

    def close(self, status: str) -> list[dict]:
        """End of output: close the open item with `status` (incomplete when cut short)."""
        out: list[dict] = []
        self._close(out, status)
        return out

    def _reasoning_delta(self, text: str, out: list[dict]) -> None:
        if self._open is None or self._open["type"] != "reasoning":
            self._close(out, "completed")
            self._add(out, {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [],
                            "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
        self._open["content"][0]["text"] += text
        out.append(self._ref("response.reasoning_text.delta", self._open, content_index=0,
                             delta=text))

    def _text_delta(self, text: str, out: list[dict]) -> None:
        if self._open is None or self._open["type"] != "message":
            text = self._pending_ws + text
            if not text.strip():
                self._pending_ws = text
                return
            self._pending_ws = ""
            self._close(out, "completed")
            self._add(out, {"type": "message", "id": _id("msg"), "role": "assistant",
                            "status": "in_progress", "content": []},
                      {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        self._open["content"][0]["text"] += text
        out.append(self._ref("response.output_text.delta", self._open, content_index=0,
                             delta=text, logprobs=[]))

    def _add(self, out: list[dict], item: dict, part: dict | None = None) -> dict:
        self.items.append(item)
        self._open = item
        out.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                    "item": copy.deepcopy(item)})
        if part is not None:
            item["content"].append(part)
            out.append(self._ref("response.content_part.added", item, content_index=0,
                                 part=copy.deepcopy(part)))
        return item

    def _close(self, out: list[dict], status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = status
        if item["type"] == "function_call":
            out.append(self._ref("response.function_call_arguments.done", item,
                                 name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            out.append(self._ref(f"response.{kind}.done", item, content_index=0,
                                 text=part["text"], **extra))
            out.append(self._ref("response.content_part.done", item, content_index=0,
                                 part=copy.deepcopy(part)))
        out.append({"type": "response.output_item.done", "output_index": self.items.index(item),
                    "item": copy.deepcopy(item)})

    def _ref(self, type_: str, item: dict, **fields) -> dict:
        return {"type": type_, "item_id": item["id"], "output_index": self.items.index(item),
                **fields}


@dataclass
class Turn:
    """One request, resolved: the conversation so far and what the engine runs."""

    body: ResponsesRequest
    response_id: str
    created_at: int
    items: list[dict]  # the stored conversation before this turn, then this turn's inputs
    inherited: int  # items[:inherited] came from previous_response_id's entry
    session_id: str | None
    warning: str | None
    namespace_of: dict[str, str]  # function name -> its namespace tool
    prepared: PreparedChat
    params: SamplingParams


class ResponsesService:
    def __init__(self, h: Handler, store: ResponseStore) -> None:
        self.h = h
        self.store = store

    async def resolve(self, body: ResponsesRequest) -> Turn:
        self.h.check_model(body.model)
        prev = None
        if body.previous_response_id:
            prev = self.store.get(body.previous_response_id)
            if prev is None:
                raise APIError(404, f"Previous response with id '{body.previous_response_id}' "
                               "not found (unknown, expired or not stored).",
                               param="previous_response_id", code="previous_response_not_found")
        items = (prev.items if prev else []) + body.input_items()
        toolset = convert_tools(body.tools)
        req = ChatRequest(messages=to_messages(items, body.instructions), tools=toolset.tools,
                          tool_choice=convert_tool_choice(body.tool_choice),
                          response_format=convert_text_format(body.text),
                          template_kwargs=body.template_kwargs(),
                          parallel_tool_calls=body.parallel_tool_calls)
        try:
            prepared = await asyncio.to_thread(self.h.chat.prepare, req)
        except ChatInputError as e:
            param = e.param
            if param and param.startswith("messages"):
                param = "input"
            raise bad_request(e.message, param=param) from e
        params = prepared.apply(body.to_sampling_params())
        warning = None
        if toolset.ignored:  # client-chosen names: a header carries printable ASCII only
            warning = re.sub(r"[^\x20-\x7e]", "?", f"ignored tools: {', '.join(toolset.ignored)}")
            warning = warning[:MAX_WARNING] + ("..." if len(warning) > MAX_WARNING else "")
        return Turn(body, _id("resp"), int(time.time()), items, len(prev.items) if prev else 0,
                    body.prompt_cache_key or (prev.session_id if prev else None), warning,
                    toolset.namespace_of, prepared, params)

    def response(self, turn: Turn, status: str, output: list[dict], usage: dict | None = None,
                 incomplete: bool = False) -> dict:
        """The response object, with the request fields the SDK reads back."""
        b = turn.body
        reasoning = b.reasoning.model_dump() if b.reasoning else {"effort": None, "summary": None}
        return {
            "id": turn.response_id, "object": "response", "created_at": turn.created_at,
            "status": status, "model": self.h.response_model(b.model), "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata or {}, "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "prompt_cache_key": b.prompt_cache_key, "reasoning": reasoning,
            "store": b.store is not False,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "text": {"format": (b.text.format if b.text and b.text.format else {"type": "text"})},
            "tool_choice": b.tool_choice,
            "tools": [t for t in b.tools or [] if t.get("type") in ("function", "namespace")],
            "truncation": "disabled", "usage": usage, "user": b.user,
        }

    def finish(self, turn: Turn, builder: OutputBuilder, out: RequestOutput) -> dict:
        """The final response object; kept in the store unless store is false."""
        incomplete = out.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        reasoning = builder.reasoning
        reasoning_tokens = (len(self.h.engine.tokenizer.encode(reasoning,
                                                              add_special_tokens=False))
                            if reasoning else 0)
        usage = {
            "input_tokens": len(out.prompt_token_ids),
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens,
                                     "cache_write_tokens": 0,
                                     **({"miss_causes": out.miss_causes}
                                        if out.miss_causes is not None else {})},
            "output_tokens": len(out.token_ids),
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens,
                                                              len(out.token_ids))},
            "total_tokens": len(out.prompt_token_ids) + len(out.token_ids)}
        resp = self.response(turn, status, builder.items, usage, incomplete)
        if turn.body.store is not False:
            self.store.put(turn.response_id, StoredResponse(
                resp, turn.items + builder.items, turn.session_id, new_from=turn.inherited))
        return resp


def register_responses_routes(app: FastAPI, h: Handler, store: ResponseStore | None = None) -> None:
    svc = ResponsesService(h, store or ResponseStore())
    app.state.response_store = svc.store

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        turn = await svc.resolve(body)
        headers = {WARNING_HEADER: turn.warning} if turn.warning else None
        try:
            it, first, timer = await h.start(request, turn.prepared.prompt_token_ids,
                                            turn.params, turn.response_id,
                                            session_id=turn.session_id,
                                            kv_transfer_params=body.kv_transfer_params,
                                            priority=body.priority,
                                            prompt_text=turn.prepared.prompt_text)
        except ClientGone:
            return Response(status_code=499)
        builder = OutputBuilder(body.parallel_tool_calls, turn.namespace_of)
        parser = turn.prepared.output_parser()
        if body.stream:
            return SSEResponse(_stream(svc, turn, builder, parser, it, first, timer),
                               headers=headers)
        try:
            out = await h.collect(request, it, first, timer, turn.response_id)
        except ClientGone:
            return Response(status_code=499)
        builder.feed(parser.feed(out.text) + parser.finish())
        builder.close("incomplete" if out.finish_reason == "length" else "completed")
        return JSONResponse(with_transfer_params(dict(svc.finish(turn, builder, out)),
                                                 body.kv_transfer_params, [out]),
                            headers=headers)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        entry = svc.store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        if not svc.store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found (unknown, expired or not "
                    "stored).", param="response_id", code="response_not_found")


def _stream(svc: ResponsesService, turn: Turn, builder: OutputBuilder, parser, it, first,
            timer):
    """The SSE body: response.created / in_progress, the builder's events, then
    response.completed (or .incomplete); every event carries its sequence_number."""
    seq = itertools.count()

    def encode(ev: dict) -> str:
        ev["sequence_number"] = next(seq)
        return sse_event(ev["type"], ev)

    def error(message: str, type_: str, code: str | None) -> str:
        return encode({"type": "error", "code": code or type_, "message": message,
                       "param": None})

    def chunks(out: RequestOutput, is_first: bool):
        if is_first:
            snapshot = svc.response(turn, "in_progress", [])
            yield {"type": "response.created", "response": snapshot}
            yield {"type": "response.in_progress", "response": snapshot}
        if out.new_text:
            yield from builder.feed(parser.feed(out.new_text))
        if out.finished:
            yield from builder.feed(parser.finish())
            yield from builder.close("incomplete" if out.finish_reason == "length"
                                     else "completed")
            resp = svc.finish(turn, builder, out)
            yield {"type": f"response.{resp['status']}", "response": resp}

    return svc.h.stream(it, first, timer, turn.response_id, chunks, encode=encode, done=None,
                        error=error)
