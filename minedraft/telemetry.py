"""OpenTelemetry tracing shared by every MineDraft service (torch-free).

Configured only through the standard ``OTEL_*`` environment variables
(https://opentelemetry.io/docs/specs/otel/configuration/sdk-environment-variables/):

- tracing is ON when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
  is set, unless ``OTEL_TRACES_EXPORTER=none`` or ``OTEL_SDK_DISABLED=true``. (The spec's default
  exporter is ``otlp``; we additionally require an endpoint so a plain local run never tries to
  reach localhost:4317 and stays a no-op.)
- ``OTEL_SERVICE_NAME`` names the service (default: the name the service passes, e.g. "gateway");
  ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_EXPORTER_OTLP_*`` (insecure, headers, timeout) and
  ``OTEL_BSP_*`` (batch span processor) are read by the SDK itself.

When tracing is off, ``init_tracing`` installs nothing: the API's default no-op tracer provider
stays, no interceptor is added to servers or channels, and ``tracer().start_span`` returns the
non-recording span, so the cost is one attribute check per call site.

Spans are exported over OTLP/gRPC (``opentelemetry-exporter-otlp-proto-grpc``) through a
``BatchSpanProcessor``; gRPC context propagates through the grpc.aio interceptors of
``opentelemetry-instrumentation-grpc`` (W3C ``traceparent`` metadata).
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Sequence

import grpc
from opentelemetry import trace

logger = logging.getLogger(__name__)

TRACER_NAME = "minedraft"
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_state = {"is_enabled": False}


def is_tracing_configured(environ: dict[str, str] | None = None) -> bool:
    """Whether the ``OTEL_*`` variables of ``environ`` (default ``os.environ``) ask for tracing."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")}
    if exporters <= {"none", ""}:
        return False
    return any(env.get(name) for name in _ENDPOINT_VARS)


def init_tracing(service_name: str) -> bool:
    """Install the global tracer provider with an OTLP/gRPC exporter when configured.

    Args:
        service_name: ``service.name`` unless ``OTEL_SERVICE_NAME`` is set.

    Returns:
        True when tracing is on. Idempotent; spans are flushed at interpreter exit.
    """
    if _state["is_enabled"]:
        return True
    if not is_tracing_configured():
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))  # + OTEL_RESOURCE_ATTRIBUTES
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)
    _state["is_enabled"] = True
    logger.info("OpenTelemetry tracing on: service %s -> %s", name,
                next(os.environ[v] for v in _ENDPOINT_VARS if os.environ.get(v)))
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporter (call before a service exits; no-op when tracing is off)."""
    provider = trace.get_tracer_provider()
    if _state["is_enabled"] and hasattr(provider, "shutdown"):
        provider.shutdown()


def is_tracing_enabled() -> bool:
    """Whether ``init_tracing`` switched tracing on in this process."""
    return _state["is_enabled"]


def tracer() -> trace.Tracer:
    """The MineDraft tracer (the no-op tracer while tracing is off)."""
    return trace.get_tracer(TRACER_NAME)


def server_interceptors() -> Sequence[grpc.aio.ServerInterceptor]:
    """grpc.aio server interceptors: one server span per RPC, parented by the caller's context."""
    if not _state["is_enabled"]:
        return ()
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return (aio_server_interceptor(filter_=_not_health_or_reflection()),)


def client_interceptors() -> Sequence[grpc.aio.ClientInterceptor]:
    """grpc.aio client interceptors: one client span per RPC, context sent in the metadata."""
    if not _state["is_enabled"]:
        return ()
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return tuple(aio_client_interceptors(filter_=_not_health_or_reflection()))


def _not_health_or_reflection():
    """Skip health checks/watches and reflection: readiness polling is not traced."""
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.any_of(filters.health_check(),
                                         filters.service_prefix("grpc.reflection.")))
