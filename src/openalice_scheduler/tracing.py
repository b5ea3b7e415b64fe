"""OpenTelemetry tracing: OTLP over gRPC when OTEL_EXPORTER_OTLP_ENDPOINT is set, a
no-op tracer otherwise. Export runs in a background thread, so an unreachable collector
costs requests nothing. A caller's trace context (W3C `traceparent`, read by
OpenTelemetry's configured propagators) is honoured either way."""

from __future__ import annotations

import logging

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Tracer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openalice_scheduler import package_version
from openalice_scheduler.config import Settings

log = logging.getLogger(__name__)


service_version = package_version


def span_attributes(
    lease_id: str, provider: str, kind: str, correlation_id: str | None
) -> dict[str, str]:
    """The attributes of a lease's provision and release spans (SPEC.md, Tracing)."""
    attributes = {"lease_id": lease_id, "provider": provider, "kind": str(kind)}
    return attributes | ({"correlation_id": correlation_id} if correlation_id else {})


class Tracing:
    def __init__(self, settings: Settings) -> None:
        self._provider = None
        endpoint = settings.otel_exporter_otlp_endpoint
        if not endpoint:
            self.tracer: Tracer = trace.NoOpTracer()
            return
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create(
            {"service.name": settings.otel_service_name, "service.version": service_version()}
        )
        self._provider = TracerProvider(resource=resource)
        exporter = OTLPSpanExporter(
            endpoint=endpoint, insecure=not endpoint.startswith("https://"), timeout=5
        )
        self._provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=500, export_timeout_millis=5000)
        )
        self.tracer = self._provider.get_tracer("openalice_scheduler", service_version())
        log.info("tracing: OTLP/gRPC to %s as %s", endpoint, settings.otel_service_name)

    @property
    def enabled(self) -> bool:
        """Spans are exported; without an exporter, none are made at all (a no-op span
        still costs ~20 µs of context switching per request)."""
        return self._provider is not None

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


class RequestSpanMiddleware:
    """One server span per HTTP request, in the caller's trace when it sent one (its
    `traceparent` span is the parent); handlers' spans become its children. With
    `tracer=None` (tracing off) no span is made, but the caller's trace context becomes
    the current one, so the log records of the request carry the caller's trace id."""

    def __init__(self, app: ASGIApp, tracer: Tracer | None) -> None:
        self.app = app
        self.tracer = tracer
        # The headers the propagators read (`traceparent`, `tracestate`, `baggage` by
        # default; OTEL_PROPAGATORS may name others): only these are handed to them.
        self.fields = frozenset(
            f.lower().encode("latin-1") for f in propagate.get_global_textmap().fields
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        parent = self._caller_context(scope)
        if self.tracer is None:
            if parent is None:
                await self.app(scope, receive, send)
                return
            token = otel_context.attach(parent)
            try:
                await self.app(scope, receive, send)
            finally:
                otel_context.detach(token)
            return
        method, path = scope["method"], scope["path"]
        with self.tracer.start_as_current_span(
            method,
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        ) as span:

            async def send_wrapper(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                await send(message)

            # Renamed by route template once answered (api/access.py).
            await self.app(scope, receive, send_wrapper)

    def _caller_context(self, scope: Scope) -> Context | None:
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in self.fields
        }
        return propagate.extract(carrier) if carrier else None
