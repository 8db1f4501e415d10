"""OpenTelemetry for the router, imported only when `otlp_endpoint` is set (opentelemetry-sdk and
opentelemetry-exporter-otlp-proto-http: the `otel` extra).

One trace per completion request: a SERVER span `pdserve.request` (continuing a client's W3C
`traceparent` if it sent one) with the request's facts as `pdserve.*` attributes (router/telemetry/tracing.py), and
one CLIENT span per backend call, made by the hook this Tracer is on the router's backend client
(router/legs/client.py: Traced, on whichever client the router runs): every P and D leg and /tokenize alike,
named by the backend's role, carrying `traceparent` to the vLLM server so that its own spans
(`--otlp-traces-endpoint`) join the same trace. A stream's span ends when the backend's response head arrives
(the time to its first byte); a whole answer's when it has come whole.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from opentelemetry import context, propagate, trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode

from pdserve.router.config import RouterConfig
from pdserve.router.telemetry.tracing import ATTRIBUTE_PREFIX
from pdserve.roles import DECODE, PREFILL

SERVICE = "pdserve-router"


class Tracer:
    def __init__(self, cfg: RouterConfig, exporter: Any = None):
        assert cfg.otlp_endpoint
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": SERVICE, "pdserve.cluster": cfg.cluster}),
            sampler=ParentBased(TraceIdRatioBased(cfg.trace_sample_ratio)))
        self.provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter(endpoint=cfg.otlp_endpoint),
                                                            schedule_delay_millis=1000))
        self.tracer = self.provider.get_tracer("pdserve.router")
        # backend base URL -> (name, role), to name the client spans
        self.backends = {b.url: (b.name, role) for role, group in ((PREFILL, cfg.prefill), (DECODE, cfg.decode))
                         for b in group}

    # -- the request's span (router/front/observe.py's middleware) ---------------------------------------
    def start(self, request: web.Request) -> tuple[Any, Any]:
        parent = propagate.extract(request.headers)
        span = self.tracer.start_span("pdserve.request", context=parent, kind=SpanKind.SERVER,
                                      attributes={"http.request.method": request.method, "url.path": request.path})
        return span, context.attach(trace.set_span_in_context(span, parent))

    def finish(self, handle: tuple[Any, Any], facts: dict[str, Any], status: int) -> str | None:
        span, token = handle
        context.detach(token)
        span.set_attribute("http.response.status_code", status)
        for key, value in facts.items():
            span.set_attribute(ATTRIBUTE_PREFIX + key, value if isinstance(value, (bool, int, float, str)) else str(value))
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()
        ctx = span.get_span_context()
        return trace.format_trace_id(ctx.trace_id) if ctx.is_valid and ctx.trace_flags.sampled else None

    # -- backend calls: the hook on the router's backend client (router/legs/client.py) ----------------
    def call_start(self, base_url: str, path: str, headers: dict[str, str]) -> Any:
        if not trace.get_current_span().get_span_context().is_valid:
            return None                      # a call outside any request (a canary): no request to hang it on
        name, role = self.backends.get(base_url, (base_url, "backend"))
        url = urlsplit(base_url)
        span = self.tracer.start_span(f"{role} {path}", kind=SpanKind.CLIENT, attributes={
            "http.request.method": "POST", "url.full": base_url + path, "server.address": url.hostname or "",
            "server.port": url.port or 0, ATTRIBUTE_PREFIX + "backend": name, ATTRIBUTE_PREFIX + "role": role})
        propagate.inject(headers, context=trace.set_span_in_context(span))
        return span

    def call_end(self, span: Any, status: int) -> None:
        if span is not None:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()

    def call_failed(self, span: Any, err: BaseException) -> None:
        if span is not None:
            span.record_exception(err)
            span.set_status(Status(StatusCode.ERROR, type(err).__name__))
            span.end()

    def shutdown(self) -> None:
        self.provider.shutdown()      # flushes what is queued
