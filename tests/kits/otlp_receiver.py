"""An OTLP/HTTP traces receiver for tests: an aiohttp server that decodes the official protobuf
(opentelemetry-proto's ExportTraceServiceRequest) into plain span records."""

from __future__ import annotations

import gzip
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                     ExportTraceServiceResponse)

PATH = "/v1/traces"


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    status_code: int
    start_ns: int
    end_ns: int


def _value(v) -> Any:
    which = v.WhichOneof("value")
    return getattr(v, which) if which in ("string_value", "bool_value", "int_value", "double_value") else str(v)


def decode(body: bytes) -> list[Span]:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                                {a.key: _value(a.value) for a in s.attributes}, s.status.code,
                                s.start_time_unix_nano, s.end_time_unix_nano))
    return out


@dataclass
class Receiver:
    spans: list[Span] = field(default_factory=list)
    url: str = ""
    runner: web.AppRunner | None = None
    since_ns: int = 0              # roots() leaves out requests that began before reset()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        assert request.headers.get("Content-Type") == "application/x-protobuf", request.headers
        self.spans.extend(decode(body))
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> "Receiver":
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post(PATH, self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        self.url = f"http://{host}:{site._server.sockets[0].getsockname()[1]}{PATH}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def roots(self, name: str = "pdserve.request") -> list[Span]:
        return [s for s in self.spans if s.name == name and s.start_ns >= self.since_ns]

    def reset(self) -> None:
        """Forget what came so far (a receiver shared by several modules): spans of earlier requests that
        arrive late are no roots of this one's."""
        self.since_ns = time.time_ns()
        self.spans.clear()
