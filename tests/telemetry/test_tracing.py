"""Tracing configuration and trace-context propagation, without processes."""

from __future__ import annotations

import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from nori.telemetry.propagation import context_from_metadata, grpc_metadata
from nori.telemetry.tracing import Tracing, traces_endpoint


def test_the_flag_wins_then_the_traces_variable_then_the_general_one() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4317",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://all:4317",
    }
    assert traces_endpoint("http://flag:4317", env) == "http://flag:4317"
    assert traces_endpoint(None, env) == "http://traces:4317"
    assert traces_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://all:4317"}) == (
        "http://all:4317"
    )
    assert traces_endpoint(None, {}) is None
    assert traces_endpoint("http://flag:4317", {"OTEL_SDK_DISABLED": "true"}) is None


def test_without_an_endpoint_tracing_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    tracing = Tracing.for_role("decode")
    assert not tracing.enabled
    with tracing.tracer.start_as_current_span("x") as span:
        assert not span.is_recording()
        assert grpc_metadata() == ()  # nothing to propagate


def test_with_an_endpoint_each_role_names_its_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    tracing = Tracing.for_role("prefill", "http://127.0.0.1:1")
    try:
        assert tracing.enabled and tracing.provider is not None
        assert tracing.provider.resource.attributes["service.name"] == "nori-prefill"
    finally:
        tracing.shutdown()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-decode")
    tracing = Tracing.for_role("decode", "http://127.0.0.1:1")
    try:
        assert tracing.provider is not None
        assert tracing.provider.resource.attributes["service.name"] == "my-decode"
    finally:
        tracing.shutdown()


def test_context_crosses_metadata_and_carriers() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("caller") as caller:
        metadata = grpc_metadata()
    assert dict(metadata)["traceparent"].split("-")[2] == trace.format_span_id(
        caller.get_span_context().span_id
    )
    # A callee's span under the caller's context, from gRPC metadata (bytes values are binary
    # metadata and ignored) and from a plain carrier (the KV hand-off's map).
    for context in (
        context_from_metadata([*metadata, ("x-bin", b"\x00")]),
        propagate.extract(dict(metadata)),
    ):
        tracer.start_span("callee", context=context).end()
    callees = [s for s in exporter.get_finished_spans() if s.name == "callee"]
    assert len(callees) == 2
    for callee in callees:
        assert callee.parent is not None
        assert callee.parent.span_id == caller.get_span_context().span_id
        assert callee.context.trace_id == caller.get_span_context().trace_id
