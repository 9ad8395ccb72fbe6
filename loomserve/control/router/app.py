"""`loomserve router`'s HTTP front: the four generation APIs proxied to instances chosen by
the policy, plus /v1/models, /health, /metrics and session ends.

Failure rules (what a client sees):
- an instance unreachable before anything was sent (refused connection, connect timeout): it
  is marked down and the request goes to the next choice, once (nothing ran, so it is safe);
- an instance failing after that: 502 in the API's error shape (OpenAI {"error": {...}},
  Anthropic {"type": "error", ...} under /v1/messages), or, once a stream started, an error
  event ending the stream (proxy.py);
- no healthy instance: 503 (and GET /health is 503 until the tokenizer has loaded).
Every response carries x-loomserve-instance (host:port) and x-loomserve-route (the reason and
the overlap in blocks when it was looked up); a disaggregated one x-loomserve-prefill (the
prefill instance, "(failed)" when its leg failed and the decode side computed the prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import replace
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from loomserve.api.auth import APIKeyMiddleware
from loomserve.api.errors import error_response, install_error_handlers
from loomserve.control.router.instances import Instance, Lease
from loomserve.control.router.miss_causes import (
    PrefillLeg,
    RouteView,
    prefill_leg_of,
    rewrite_json,
    rewrite_sse,
)
from loomserve.control.router.pd import decode_body, prefill_body
from loomserve.control.router.proxy import (
    ClosingStream,
    InstanceLost,
    Upstream,
    request_headers,
    response_headers,
    response_id_in,
)
from loomserve.control.router.routing import NoInstance, Router
from loomserve.control.router.tokens import (
    API_CHAT,
    API_COMPLETIONS,
    API_MESSAGES,
    API_RESPONSES,
)

logger = logging.getLogger("loomserve.control.router")
ROUTES = {"/v1/chat/completions": API_CHAT, "/v1/completions": API_COMPLETIONS,
          "/v1/messages": API_MESSAGES, "/v1/responses": API_RESPONSES}
CHARS_PER_TOKEN = 4  # load estimate for a prompt the router did not tokenize


def prompt_size(api: str, body: dict, raw: bytes) -> int:
    """Prompt tokens for load accounting when the policy did not tokenize: a token-id prompt's
    length, else the body's size over CHARS_PER_TOKEN."""
    prompt = body.get("prompt") if api == API_COMPLETIONS else None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    return len(raw) // CHARS_PER_TOKEN


def _error(status: int, message: str, path: str, code: str) -> JSONResponse:
    kind = {502: "bad_gateway", 503: "service_unavailable_error"}.get(status,
                                                                     "invalid_request_error")
    return error_response(status, message, kind, code=code, path=path)


class RouterService:
    """The request paths of the app (the routes only parse and dispatch)."""

    def __init__(self, router: Router, instance_api_key: str | None, read_timeout: float,
                 tracing=None):
        self.router = router
        self.tracing = tracing  # api.tracing.Tracing, or None: no span, no SDK import
        self.metrics = router.metrics
        self.instance_api_key = instance_api_key
        self.upstream = Upstream(read_timeout)
        self._background: set[asyncio.Task] = set()  # held until done (tasks are weak refs)

    async def generate(self, request: Request, api: str) -> Response:
        if self.tracing is None:
            return await self._generate(request, api, None)
        from loomserve.api.tracing import ProxyTrace
        trace = ProxyTrace(self.tracing, request.headers, api)
        try:
            resp = await self._generate(request, api, trace)
        except BaseException as e:
            trace.end(error=e)
            raise
        if isinstance(resp, ClosingStream):  # the request ends with its stream
            inner = resp.on_close

            async def on_close() -> None:
                try:
                    await inner()
                finally:
                    trace.end(resp.status_code)
            resp.on_close = on_close
        else:
            trace.end(resp.status_code)
        return resp

    async def _generate(self, request: Request, api: str, trace) -> Response:
        path = request.url.path
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as e:
            return _error(400, f"Malformed JSON body: {e}", path, "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "The body must be a JSON object.", path, "invalid_json")
        req = self.router.request(api, body, request.headers)
        await self.router.prepare(req)
        headers = request_headers(request.headers, self.instance_api_key)
        tried: tuple[Instance, ...] = ()
        pd_done = False
        leg_usage: PrefillLeg | None = None
        for _ in range(2):  # a second choice only when the first was unreachable
            try:
                d = self.router.decide(req, body, tried)
            except NoInstance as e:
                self.metrics.errors.labels("no_instance").inc()
                return _error(503, str(e), path, "no_healthy_instance")
            if d.moved_from is not None and req.session is not None:
                self._release_session(d.moved_from, req.session, headers)
            content = raw
            extra = {"x-loomserve-instance": d.instance.name, "x-loomserve-route": d.reason + (
                f"; overlap={d.overlap}" if d.overlap is not None else "")}
            if not pd_done:
                pd_done = True
                if (target := self.router.prefill_target(req, d)) is not None:
                    leg, leg_headers = (None, headers) if trace is None else trace.leg(
                        "prefill_leg", target.name, headers)
                    params, leg_usage = await self._prefill(target, api, path, body,
                                                            leg_headers)
                    if leg is not None:
                        leg.end()
                    if leg_usage is not None:
                        leg_usage = replace(leg_usage, view=self.router.leg_view(req, target))
                    content = json.dumps(decode_body(body, params) if params else body).encode()
                    extra["x-loomserve-prefill"] = target.name + ("" if params else " (failed)")
            tokens = req.known_tokens or prompt_size(api, body, raw)
            lease = Lease(d.instance, tokens, self.router.instances.block_size())
            leg_headers = headers if trace is None else trace.leg(
                "decode_leg" if "x-loomserve-prefill" in extra else "upstream", d.instance.name,
                headers)[1]
            try:
                resp = await self.upstream.open(d.instance, "POST", path, content, leg_headers)
            except asyncio.CancelledError:  # the client went away: nothing holds the lease
                lease.release()
                raise
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                lease.release()
                self.metrics.errors.labels("connect").inc()
                self.router.instances.mark_down(d.instance, f"unreachable: {e!r}")
                tried += (d.instance,)
                continue
            except (httpx.HTTPError, InstanceLost) as e:
                lease.release()
                return self._failed(d.instance, e, path)
            return await self._answer(resp, d.instance, lease, api, body, extra, path,
                                      self.router.miss_view(req, d), leg_usage, trace)
        return _error(502, "No instance could be reached.", path, "instance_unreachable")

    def _release_session(self, home: Instance, session: str, headers: dict) -> None:
        """A session left its home (overloaded, or its context lost there): unpin its blocks
        there (in the background; a failure only leaves them to the instance's own eviction)."""
        async def release() -> None:
            try:
                await self.upstream.client.delete(
                    f"{home.url}/v1/sessions/{quote(session, safe='')}", timeout=5,
                    headers={k: v for k, v in headers.items()
                             if k.lower() in ("authorization", "x-api-key")})
            except httpx.HTTPError as e:
                logger.debug("releasing session %s on %s failed: %s", session, home.name, e)
        task = asyncio.create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _answer(self, resp: httpx.Response, inst: Instance, lease: Lease, api: str,
                      body: dict, extra: dict, path: str, view: RouteView | None = None,
                      prefill: PrefillLeg | None = None, trace=None) -> Response:
        hdrs = response_headers(resp.headers, extra)
        remember = ((lambda rid: self.router.remember_response(rid, inst))
                    if api == API_RESPONSES else None)
        if body.get("stream") and resp.status_code == 200:
            async def on_close() -> None:
                lease.release()
                await resp.aclose()
            return ClosingStream(
                self._attribute_stream(self.upstream.relay(
                    resp, inst, lease, api, lambda kind: self.metrics.errors.labels(kind).inc(),
                    remember), view, prefill, trace),
                status_code=200, headers=hdrs, media_type=resp.headers.get("content-type"),
                on_close=on_close)
        try:
            data = await self.upstream.read_all(resp, inst)
        except (httpx.HTTPError, InstanceLost) as e:
            return self._failed(inst, e, path)
        finally:
            lease.release()
        if remember is not None and resp.status_code == 200 and (rid := response_id_in(data)):
            remember(rid)
        if resp.status_code == 200:
            new, causes = rewrite_json(data, view, self.router.instances.block_size(),
                                       prefill)
            self._count(causes, trace)
            if new is not data:  # its length changed: Response sets it anew
                hdrs = {k: v for k, v in hdrs.items() if k.lower() != "content-length"}
            data = new
        return Response(data, status_code=resp.status_code, headers=hdrs)

    async def _attribute_stream(self, chunks, view: RouteView | None,
                                prefill: PrefillLeg | None, trace):
        """A stream relayed in whole lines: its usage line rewritten (the prefill leg's causes
        merged, the router's moved in: miss_causes.rewrite_sse) and its causes counted. A
        line split across chunks waits for its end (chunks are whole events as a rule)."""
        bs = self.router.instances.block_size()
        held = b""
        async for chunk in chunks:
            data = held + chunk if held else chunk
            cut = data.rfind(b"\n") + 1
            held = data[cut:]
            if cut:
                yield self._rewrite_lines(data[:cut], view, bs, prefill, trace)
        if held:
            yield self._rewrite_lines(held, view, bs, prefill, trace)

    def _rewrite_lines(self, block: bytes, view: RouteView | None, bs: int,
                       prefill: PrefillLeg | None, trace) -> bytes:
        block, found = rewrite_sse(block, view, bs, prefill)
        for causes in found:
            self._count(causes, trace)
        return block

    def _count(self, causes: dict | None, trace=None) -> None:
        """Count a relayed answer's causes (and put them on its trace's request span)."""
        causes = {k: n for k, n in (causes or {}).items() if isinstance(n, int) and n > 0}
        for cause, n in causes.items():
            self.metrics.miss.labels(cause).inc(n)
        if trace is not None and causes:
            trace.miss(causes)

    def _failed(self, inst: Instance, e: Exception, path: str) -> JSONResponse:
        kind = "instance_lost" if isinstance(e, InstanceLost) else "upstream_error"
        self.metrics.errors.labels(kind).inc()
        return _error(502, f"The instance {inst.name} failed: {e or type(e).__name__}", path,
                      "instance_failed")

    async def _prefill(self, target: Instance, api: str, path: str, body: dict,
                       headers: dict) -> tuple[dict | None, PrefillLeg | None]:
        """The prefill leg: its kv_transfer_params, or None (the decode leg recomputes), and
        its usage's miss causes (merged into the decode leg's answer)."""
        content = json.dumps(prefill_body(api, body)).encode()
        lease = Lease(target, 0, self.router.instances.block_size())
        try:
            resp = await self.upstream.open(target, "POST", path, content, headers)
            data = await self.upstream.read_all(resp, target)
            answer = json.loads(data) if resp.status_code == 200 else {}
            params = answer.get("kv_transfer_params")
        except (httpx.HTTPError, InstanceLost, ValueError, AttributeError) as e:
            logger.warning("prefill leg on %s failed: %s", target.name, e)
            params = None
        finally:
            lease.release()
        self.metrics.pd.labels("disaggregated" if isinstance(params, dict)
                               else "prefill_failed").inc()
        if not isinstance(params, dict):
            return None, None
        return params, prefill_leg_of(answer)

    async def forward(self, request: Request, inst: Instance | None) -> Response:
        """A plain request (models, token counts, stored responses) to `inst` or any
        healthy instance, with its answer as is."""
        path = request.url.path
        healthy = self.router.instances.healthy()
        inst = inst if inst is not None and inst.up else (healthy[0] if healthy else None)
        if inst is None:
            return _error(503, "No healthy instance.", path, "no_healthy_instance")
        headers = request_headers(request.headers, self.instance_api_key)
        try:
            resp = await self.upstream.open(inst, request.method, path + (
                f"?{request.url.query}" if request.url.query else ""),
                await request.body() or None, headers)
            data = await self.upstream.read_all(resp, inst)
        except (httpx.HTTPError, InstanceLost) as e:
            return self._failed(inst, e, path)
        return Response(data, status_code=resp.status_code,
                        headers=response_headers(resp.headers, {}))


def build_router_app(router: Router, *, api_keys: list[str] | None = None,
                     instance_api_key: str | None = None,
                     read_timeout: float = 600.0,
                     otlp_traces_endpoint: str | None = None) -> FastAPI:
    tracing = None
    if otlp_traces_endpoint:  # else the SDK is never imported
        from loomserve.api.tracing import Tracing
        tracing = Tracing(otlp_traces_endpoint, "loomserve-router")
    svc = RouterService(router, instance_api_key, read_timeout, tracing)
    instances = router.instances

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await instances.start()
        tok = asyncio.create_task(router.load_tokenizer())
        try:
            yield
        finally:
            tok.cancel()
            await instances.stop()
            await svc.upstream.aclose()
            if tracing is not None:
                tracing.shutdown()

    app = FastAPI(title="loomserve router", lifespan=lifespan)
    app.state.router = router
    install_error_handlers(app)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, keys=api_keys)

    for route, api in ROUTES.items():
        async def generate(request: Request, api: str = api) -> Response:
            return await svc.generate(request, api)
        app.add_api_route(route, generate, methods=["POST"], include_in_schema=False)

    @app.get("/health")
    async def health() -> JSONResponse:
        rows = [{"instance": i.name, "url": i.url, "up": i.up, "role": i.role,
                 "active_requests": i.active_requests, "active_blocks": round(i.active_blocks, 2),
                 "cached_blocks": router.index.blocks_of(i.name)} for i in instances.instances]
        # Ready once an instance is up and the tokenizer settled: before that, KV-aware
        # placement and the prefill/decode split would run blind (a readiness probe waits).
        up = any(r["up"] for r in rows)
        ok = up and router.tokenizer_settled
        status = "ok" if ok else ("loading the tokenizer" if up else "no healthy instance")
        return JSONResponse({"status": status,
                             "policy": router.policy.name,
                             "tokenizer": router.keys is not None, "instances": rows},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        router.metrics.refresh(instances, router.index, router.policy)
        data, ctype = router.metrics.render()
        return Response(data, media_type=ctype)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await svc.forward(request, None)

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> Response:
        return await svc.forward(request, None)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await svc.forward(request, None)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str, request: Request) -> Response:
        return await svc.forward(request, router.response_home(response_id))

    @app.delete("/v1/sessions/{session_id}")
    async def end_session(session_id: str, request: Request) -> Response:
        home = router.forget_session(session_id)
        inst = instances.by_name(home) if home else None
        if inst is not None:
            return await svc.forward(request, inst)
        # Home unknown (a hashing policy, or a session this router never saw): every healthy
        # instance is told; ending a session is idempotent on an instance.
        await asyncio.gather(*(svc.forward(request, i) for i in instances.healthy()))
        return JSONResponse({"id": session_id, "object": "session", "deleted": True})

    return app
