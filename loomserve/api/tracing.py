"""OpenTelemetry traces (`--otlp-traces-endpoint`, vLLM's flag; else
$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: serve.traces_endpoint), exported over OTLP/HTTP with opentelemetry-sdk.

One trace per request across processes, by W3C traceparent: the client's (when it sends one)
parents the router's `request` span; the router's `prefill_leg` and `decode_leg` (or
`upstream`) client spans parent each instance's `request` server span; a prefill leg returns
its span's traceparent inside kv_transfer_params, which the decode instance links to (and
parents to, when no router sent a traceparent header).

An instance's spans are made in the front end from the times it already sees (arrival, the
core's queue wait, the first token, the last), so the engine core never touches the SDK:
`queue` (a decode leg's is `kv_transfer`: the pull of the prefill's pages happens before
admission), `prefill` (admission to the first token), `decode`. Attributes use vLLM's
gen_ai.* names. Tracing off: this module is never imported, so no SDK import and no cost.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import (
    Link,
    SpanKind,
    Status,
    StatusCode,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()


def traces_url(endpoint: str) -> str:
    """OTLP/HTTP's traces URL: a bare host:port gets the standard /v1/traces path."""
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    return endpoint.rstrip("/") + "/v1/traces" if urlsplit(endpoint).path in ("", "/") \
        else endpoint


class Tracing:
    """A tracer provider of its own (never the global one: a test process holds several apps),
    exporting in batches from a background thread."""

    def __init__(self, endpoint: str, service_name: str) -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self.tracer = self.provider.get_tracer("loomserve")

    def shutdown(self) -> None:
        """Export what is buffered, then stop."""
        self.provider.shutdown()

    def server_span(self, name: str, headers, start_ns: int | None = None, links=()):
        """A SERVER span whose parent is the incoming traceparent header, if any."""
        return self.tracer.start_span(name, context=extract(headers), kind=SpanKind.SERVER,
                                      start_time=start_ns, links=links)

    def child(self, parent, name: str, kind=SpanKind.INTERNAL, start_ns: int | None = None,
              end_ns: int | None = None, links=()):
        """A span under `parent`; ended at end_ns when given."""
        span = self.tracer.start_span(name, context=set_span_in_context(parent), kind=kind,
                                      start_time=start_ns, links=links)
        if end_ns is not None:
            span.end(end_time=end_ns)
        return span

    def request(self, headers, request_id: str, kv_transfer_params, model: str, params):
        """An instance's RequestTrace, its server span started now."""
        return RequestTrace(self, headers, request_id, kv_transfer_params, model, params)


def extract(carrier) -> Context | None:
    """The context a traceparent in `carrier` (headers, or a dict) names; None without one."""
    if not carrier or not carrier.get(TRACEPARENT):
        return None
    return _PROPAGATOR.extract({TRACEPARENT: carrier.get(TRACEPARENT)})


def traceparent_of(span) -> str:
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=set_span_in_context(span))
    return carrier[TRACEPARENT]


def with_traceparent(headers: dict[str, str], span) -> dict[str, str]:
    """Outgoing headers with `span` as the parent of whatever the request starts there."""
    out = {k: v for k, v in headers.items() if k.lower() != TRACEPARENT}
    out[TRACEPARENT] = traceparent_of(span)
    return out


def fail(span, e: BaseException) -> None:
    span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
    span.end()


class RequestTrace:
    """One engine request's spans on an instance: the server span lives from arrival to the
    finished output; its phases are added at the end, from RequestTiming."""

    def __init__(self, tracing: Tracing, headers, request_id: str, kv_transfer_params, model,
                 params) -> None:
        self.tracing = tracing
        # A decode leg: the prefill leg's span, carried in the params (the router passes
        # them through unread); parent too when no traceparent header came with the request.
        prefill = extract(kv_transfer_params) if isinstance(kv_transfer_params, dict) else None
        self.prefill_span = get_current_span(prefill).get_span_context() if prefill else None
        self.decode_leg = self.prefill_span is not None
        carrier = headers if headers.get(TRACEPARENT) else kv_transfer_params
        self.span = tracing.tracer.start_span(
            "request", context=extract(carrier), kind=SpanKind.SERVER)
        self.span.set_attributes({
            "gen_ai.request.id": request_id, "gen_ai.response.model": model,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p})
        if params.max_tokens is not None:
            self.span.set_attribute("gen_ai.request.max_tokens", params.max_tokens)

    def traceparent(self) -> str:
        return traceparent_of(self.span)

    def fail(self, e: BaseException) -> None:
        fail(self.span, e)

    def finish(self, t, out) -> None:
        """End the request at its finished output (t: metrics.RequestTiming); a prefill leg's
        kv_transfer_params get this span's traceparent for the decode leg."""
        ns = lambda s: t.arrival_ns + int(s * 1e9)  # noqa: E731
        links = [Link(self.prefill_span)] if self.decode_leg else ()
        phases = (("kv_transfer" if self.decode_leg else "queue", 0.0, t.queue_s),
                  ("prefill", t.queue_s, t.queue_s + t.prefill_s),
                  ("decode", t.queue_s + t.prefill_s, t.e2e_s))
        for name, start, end in phases:
            self.tracing.child(self.span, name, start_ns=ns(start), end_ns=ns(end),
                               links=links if name == "kv_transfer" else ())
        self.span.set_attributes({
            "gen_ai.usage.prompt_tokens": t.prompt_tokens,
            "gen_ai.usage.completion_tokens": t.output_tokens,
            "gen_ai.usage.cached_tokens": t.cached_tokens,
            "loomserve.usage.tier_cached_tokens": t.tier_cached_tokens,
            "gen_ai.response.finish_reasons": [out.finish_reason or "unknown"],
            "gen_ai.latency.time_in_queue": t.queue_s,
            "gen_ai.latency.time_in_model_prefill": t.prefill_s,
            "gen_ai.latency.time_in_model_decode": t.decode_s,
            "gen_ai.latency.time_in_model_inference": t.prefill_s + t.decode_s,
            "gen_ai.latency.e2e": t.e2e_s})
        if t.ttft_s is not None:
            self.span.set_attribute("gen_ai.latency.time_to_first_token", t.ttft_s)
        for cause, tokens in (getattr(out, "miss_causes", None) or {}).items():
            self.span.set_attribute(f"loomserve.prefix_cache.miss_tokens.{cause}", tokens)
        if isinstance(out.kv_transfer_params, dict):
            out.kv_transfer_params[TRACEPARENT] = self.traceparent()
        self.span.end(end_time=ns(t.e2e_s))


class ProxyTrace:
    """The router's spans of one request: `request` (server, under the client's traceparent)
    and one client span per leg sent to an instance, whose traceparent the leg carries."""

    def __init__(self, tracing: Tracing, headers, api: str) -> None:
        self.tracing = tracing
        self.span = tracing.server_span("request", headers)
        self.span.set_attribute("loomserve.api", api)
        self.legs: list = []

    def leg(self, name: str, instance: str, headers: dict[str, str]):
        """A leg's span (prefill_leg, decode_leg, upstream) and the headers that carry it."""
        span = self.tracing.child(self.span, name, kind=SpanKind.CLIENT)
        span.set_attribute("loomserve.instance", instance)
        self.legs.append(span)
        return span, with_traceparent(headers, span)

    def miss(self, causes: dict[str, int]) -> None:
        """The causes the client's usage reports (the router's moved in, a prefill leg's
        merged: control.router.miss_causes), as the instances' spans carry theirs."""
        for cause, tokens in causes.items():
            self.span.set_attribute(f"loomserve.prefix_cache.miss_tokens.{cause}", tokens)

    def end(self, status_code: int | None = None, error: BaseException | None = None) -> None:
        """End every open leg, then the request."""
        for span in self.legs:
            if span.is_recording():
                span.end()
        if status_code is not None:
            self.span.set_attribute("http.response.status_code", status_code)
        if error is not None:
            fail(self.span, error)
        elif self.span.is_recording():
            self.span.end()
