"""A real OTLP/gRPC trace receiver for tests: what Jaeger's or a collector's port 4317 speaks.

It serves `opentelemetry.proto.collector.trace.v1.TraceService/Export` with the generated stubs
of the `opentelemetry-proto` package and keeps every span it is sent, flattened with the
service.name of the process that sent it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    # (trace id, span id) of each span it links to.
    links: tuple[tuple[str, str], ...] = ()


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: Callable[[ReceivedSpan], None]) -> None:
        self._sink = sink

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self._sink(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            links=tuple(
                                (link.trace_id.hex(), link.span_id.hex()) for link in span.links
                            ),
                        )
                    )
        return trace_service_pb2.ExportTraceServiceResponse()


class OTLPReceiver:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            _TraceService(self._add), self._server
        )
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _add(self, span: ReceivedSpan) -> None:
        with self._lock:
            self._spans.append(span)

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def wait_for(
        self, trace_id: str, ready: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0
    ) -> list[ReceivedSpan]:
        """The trace's spans once `ready` says they are all in (exporters batch them)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = self.spans(trace_id)
            if ready(spans):
                return spans
            time.sleep(0.1)
        raise AssertionError(
            f"trace {trace_id} incomplete after {timeout_s} s: "
            f"{sorted((s.service, s.name) for s in self.spans(trace_id))}"
        )

    def __enter__(self) -> OTLPReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)
