"""A trace's context across process boundaries (gRPC metadata, the KV hand-off), through
OpenTelemetry's configured propagator (`OTEL_PROPAGATORS`, W3C Trace Context by default)."""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import propagate, trace
from opentelemetry.context import Context


def current_carrier(span: trace.Span | None = None) -> dict[str, str]:
    """The context of `span` (else the current one) as text headers; empty when not recording."""
    context = trace.set_span_in_context(span) if span is not None else None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier


def grpc_metadata(span: trace.Span | None = None) -> tuple[tuple[str, str], ...]:
    """Call metadata that makes the callee's spans children of `span` (or the current one)."""
    return tuple(current_carrier(span).items())


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The caller's trace context from a gRPC call's invocation metadata."""
    carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
    return propagate.extract(carrier)
