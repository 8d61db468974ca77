"""Each role's tracer: spans exported over OTLP/gRPC when an endpoint is set, none otherwise.

Configured as OpenTelemetry is: `--otlp-traces-endpoint` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
/ `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME` over the role's default name, and the other
`OTEL_*` variables; no endpoint: OpenTelemetry's no-op tracer. Nothing is installed globally."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

logger = logging.getLogger(__name__)

# The service.name of each role in a trace (OTEL_SERVICE_NAME overrides it).
SERVICE_NAMES = {
    "gateway": "nori-gateway",
    "prefill": "nori-prefill",
    "decode": "nori-decode",
    "colocated": "nori-colocated",
}
TRACER_NAME = "nori"


def traces_endpoint(flag: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """Where spans go: the flag, else OpenTelemetry's variables; None: tracing is off."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    return (
        flag
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or None
    )


@dataclass
class Tracing:
    """A role's tracer and, when tracing is on, the provider to flush at shutdown."""

    tracer: trace.Tracer
    provider: TracerProvider | None = None

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    @classmethod
    def off(cls) -> Tracing:
        return cls(trace.NoOpTracer())

    @classmethod
    def for_role(cls, role: str, endpoint_flag: str | None = None) -> Tracing:
        endpoint = traces_endpoint(endpoint_flag)
        if endpoint is None:
            return cls.off()
        # Imported only when used: the exporter pulls in its gRPC stubs.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        name = os.environ.get("OTEL_SERVICE_NAME") or SERVICE_NAMES.get(role, f"nori-{role}")
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
        # An "http://" endpoint is plaintext gRPC, "https://" TLS (the exporter's own rule).
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        logger.info("tracing: %s sends spans to %s over OTLP/gRPC", name, endpoint)
        return cls(provider.get_tracer(TRACER_NAME), provider)

    def shutdown(self) -> None:
        """Sends the spans still batched (a process's last requests) and stops the exporter."""
        if self.provider is not None:
            self.provider.shutdown()
