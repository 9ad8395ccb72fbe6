"""Anthropic Messages API: POST /v1/messages, POST /v1/messages/count_tokens.

A request converts to the neutral chat request (anthropic_protocol.py), the chat front end
renders it and builds its grammar, and the output parser's events become content blocks:
thinking, text and tool_use, in the order the model wrote them, one block open at a time
(streaming and non-streaming fold the same events, so both give the same content).
Thinking blocks carry a stable `signature` (a digest of their text): clients require the
field; the server never checks it on input.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from loomserve.api.anthropic_protocol import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    Usage,
)
from loomserve.api.chat.events import (
    ChatEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallStart,
)
from loomserve.api.chat.frontend import ChatInputError
from loomserve.api.errors import anthropic_error_body, bad_request
from loomserve.api.handler import (
    WARNING_HEADER,
    ClientGone,
    Handler,
    SSEResponse,
    sse_event,
    with_transfer_params,
)
from loomserve.engine.output import RequestOutput

logger = logging.getLogger("loomserve.api")


def register_anthropic_routes(app: FastAPI, h: Handler) -> None:
    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        h.check_model(body.model)
        req, ignored = body.to_chat_request()
        prepared = await _prepare(h, req)
        params = prepared.apply(body.to_sampling_params())
        capped = _fit_context(h, params, len(prepared.prompt_token_ids))
        request_id = f"msg_{uuid.uuid4().hex[:24]}"
        session = body.metadata.user_id if body.metadata else None
        headers = _warning_headers(ignored)
        try:
            it, first, timer = await h.start(request, prepared.prompt_token_ids, params,
                                            request_id, session_id=session,
                                            kv_transfer_params=body.kv_transfer_params,
                                            priority=body.priority,
                                            prompt_text=prepared.prompt_text)
        except ClientGone:
            return Response(status_code=499)
        turn = _Turn(h, body, prepared.output_parser(), request_id, params, capped)
        if body.stream:
            return SSEResponse(
                h.stream(it, first, timer, request_id, turn.stream_events,
                         encode=lambda e: sse_event(e["type"], e), done=None,
                         error=_stream_error),
                headers=headers)
        try:
            out = await h.collect(request, it, first, timer, request_id)
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(with_transfer_params(turn.message(out).model_dump(),
                                                 body.kv_transfer_params, [out]),
                            headers=headers)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict:
        h.check_model(body.model)
        req, _ = body.to_chat_request()
        # prepare(), not count_tokens(): a forced tool_choice or format may render the template
        # differently (thinking off), and the count must be the prompt /v1/messages would use.
        return {"input_tokens": len((await _prepare(h, req)).prompt_token_ids)}


async def _prepare(h: Handler, req):
    try:
        return await asyncio.to_thread(h.chat.prepare, req)
    except (ChatInputError, ValueError) as e:
        raise _input_error(e) from e


def _input_error(e: ValueError):
    message = getattr(e, "message", None) or str(e)
    param = getattr(e, "param", None)
    # The front end names neutral fields; Anthropic's error body has no param, so say it here.
    return bad_request(f"{param}: {message}" if param and param not in message else message)


def _fit_context(h: Handler, params, prompt_len: int) -> bool:
    """Cap max_tokens at the room the context leaves, as Anthropic does for models that stop
    with model_context_window_exceeded: agents ask for more output than a local model's context
    holds (Claude Code: 32000). True if capped; a prompt with no room is a 400."""
    room = h.engine.max_model_len - prompt_len
    if room < 1:
        raise bad_request(f"prompt is too long: {prompt_len} tokens > "
                          f"{h.engine.max_model_len - 1} maximum")
    if params.max_tokens is not None and params.max_tokens <= room:
        return False
    params.max_tokens = room
    return True


def _warning_headers(ignored: list[str]) -> dict[str, str] | None:
    if not ignored:
        return None
    return {WARNING_HEADER: "server tools are not supported and were ignored: "
                            + ", ".join(ignored)}


def _stream_error(message: str, type: str, code: str | None) -> str:
    status = 503 if code == "engine_unavailable" else 500
    return sse_event("error", anthropic_error_body(status, message))


class _Turn:
    """One assistant turn: the output parser's events -> content blocks and stream events."""

    def __init__(self, h: Handler, body: MessagesRequest, parser, request_id: str,
                 params, capped: bool) -> None:
        self.h, self.body, self.parser, self.capped = h, body, parser, capped
        self.model = h.response_model(body.model)
        self.request_id, self.params = request_id, params
        self.blocks = BlockAssembler(max_calls=None if body.parallel_tool_calls else 1)

    def message(self, out: RequestOutput) -> MessageResponse:
        self.blocks.feed(self.parser.feed(out.text) + self.parser.finish())
        self.blocks.close()
        reason, seq = self._stop(out)
        return MessageResponse(id=self.request_id, model=self.model,
                               content=self.blocks.blocks, stop_reason=reason,
                               stop_sequence=seq, usage=_usage(out))

    def stream_events(self, out: RequestOutput, is_first: bool):
        if is_first:
            start = MessageResponse(id=self.request_id, model=self.model, content=[],
                                    usage=_usage(out, output_tokens=0))
            yield {"type": "message_start", "message": start.model_dump()}
            yield {"type": "ping"}
        events = self.parser.feed(out.new_text) if out.new_text else []
        if out.finished:
            events += self.parser.finish()
        yield from self.blocks.feed(events)
        if out.finished:
            yield from self.blocks.close()
            reason, seq = self._stop(out)
            yield {"type": "message_delta",
                   "delta": {"stop_reason": reason, "stop_sequence": seq},
                   "usage": _usage(out).model_dump()}
            yield {"type": "message_stop"}

    def _stop(self, out: RequestOutput) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        if out.finish_reason == "length":
            return ("model_context_window_exceeded" if self.capped else "max_tokens"), None
        if self.blocks.has_tool_use:
            return "tool_use", None
        if out.finish_reason == "stop" and out.stop_reason is not None:
            return "stop_sequence", out.stop_reason
        return "end_turn", None


def _usage(out: RequestOutput, output_tokens: int | None = None) -> Usage:
    n = len(out.token_ids) if output_tokens is None else output_tokens
    usage = Usage.of(len(out.prompt_token_ids), out.num_cached_tokens, n)
    if out.miss_causes is not None:
        usage.miss_causes = out.miss_causes  # extra="allow": serialized only when set
    return usage


class BlockAssembler:
    """Chat events -> Anthropic content blocks and the stream events that build them.

    Invariants: one block is open at a time; a block's deltas come between its
    content_block_start and content_block_stop; `blocks` ends equal to what the stream
    events build. Whitespace that would open a text or thinking block is held until real
    text follows, so a turn of only tool calls has no stray text block. With max_calls, tool
    calls past that many are dropped (disable_parallel_tool_use without a grammar).
    """

    def __init__(self, max_calls: int | None = None) -> None:
        self.blocks: list[dict] = []
        self.max_calls = max_calls
        self._open: int | None = None  # index of the open block
        self._held = ("", "")  # (kind, whitespace) not yet in a block
        self._calls: dict[int, int] = {}  # tool call index -> block index
        self._args: dict[int, list[str]] = {}  # block index -> argument text so far

    @property
    def has_tool_use(self) -> bool:
        return bool(self._calls)

    def feed(self, events: list[ChatEvent]) -> list[dict]:
        out: list[dict] = []
        for ev in events:
            if isinstance(ev, TextDelta):
                self._delta("text", ev.text, out)
            elif isinstance(ev, ReasoningDelta):
                self._delta("thinking", ev.text, out)
            elif isinstance(ev, ToolCallStart):
                self._start_call(ev, out)
            elif isinstance(ev, ToolCallArgs) and ev.index in self._calls:
                i = self._calls[ev.index]
                self._args[i].append(ev.text)
                out.append(_delta_event(i, {"type": "input_json_delta", "partial_json": ev.text}))
        return out

    def close(self) -> list[dict]:
        """Close the open block (at the end of the turn)."""
        out: list[dict] = []
        self._close(out)
        return out

    def _delta(self, kind: str, text: str, out: list[dict]) -> None:
        if self._open is not None and self.blocks[self._open]["type"] == kind:
            self.blocks[self._open][kind] += text
            out.append(_delta_event(self._open, {"type": f"{kind}_delta", kind: text}))
            return
        held = self._held[1] if self._held[0] == kind else ""
        if not (held + text).strip():
            self._held = (kind, held + text)
            return
        self._held = ("", "")
        block = {"type": "text", "text": ""} if kind == "text" else \
            {"type": "thinking", "thinking": "", "signature": ""}
        self._open_block(block, out)
        self._delta(kind, held + text, out)

    def _start_call(self, ev: ToolCallStart, out: list[dict]) -> None:
        if self.max_calls is not None and len(self._calls) >= self.max_calls:
            return
        self._open_block({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                          "name": ev.name, "input": {}}, out)
        self._calls[ev.index] = self._open
        self._args[self._open] = []

    def _open_block(self, block: dict, out: list[dict]) -> None:
        self._close(out)
        self._held = ("", "")
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        out.append({"type": "content_block_start", "index": self._open,
                    "content_block": dict(block)})

    def _close(self, out: list[dict]) -> None:
        i = self._open
        if i is None:
            return
        block = self.blocks[i]
        if block["type"] == "thinking":
            block["signature"] = hashlib.sha256(block["thinking"].encode()).hexdigest()
            out.append(_delta_event(i, {"type": "signature_delta",
                                        "signature": block["signature"]}))
        elif block["type"] == "tool_use":
            block["input"] = _arguments(self._args[i])
        out.append({"type": "content_block_stop", "index": i})
        self._open = None


def _delta_event(index: int, delta: dict) -> dict:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _arguments(parts: list[str]) -> dict:
    text = "".join(parts)
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        # Only a call cut off by max_tokens ends unparsable (the parser's invariant).
        logger.debug("tool call arguments are not complete JSON: %.200s", text)
        return {}
    return value if isinstance(value, dict) else {}
