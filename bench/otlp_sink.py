"""An OTLP/gRPC trace receiver that counts what it is sent: the collector for measuring what
tracing costs (`bench/serving_suite.sh tracing`) where no Jaeger runs.

    python -m nori.bench.otlp_sink --port 4317 [--out counts.json] [--spans spans.jsonl]

On SIGINT or SIGTERM it writes {"spans": N, "traces": M} to --out (or stdout) and exits. With
`--spans` it also writes every span as one JSON line (service, name, trace and span ids, parent,
start and end in ns, attributes), for breaking a latency into its phases.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Iterable
from concurrent import futures
from typing import Any, TextIO

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2


class _CountingService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, spans_out: TextIO | None) -> None:
        self.lock = threading.Lock()
        self.spans = 0
        self.trace_ids: set[bytes] = set()
        self._spans_out = spans_out

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for resource_spans in request.resource_spans:
                service = _service_name(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans += 1
                        self.trace_ids.add(span.trace_id)
                        if self._spans_out is not None:
                            self._spans_out.write(json.dumps(_span_record(service, span)) + "\n")
        return trace_service_pb2.ExportTraceServiceResponse()


def _service_name(attributes: Iterable[common_pb2.KeyValue]) -> str:
    return next((a.value.string_value for a in attributes if a.key == "service.name"), "")


def _span_record(service: str, span: trace_pb2.Span) -> dict[str, Any]:
    attributes = {}
    for attribute in span.attributes:
        kind = attribute.value.WhichOneof("value")
        attributes[attribute.key] = getattr(attribute.value, kind) if kind else None
    return {
        "service": service,
        "name": span.name,
        "trace": span.trace_id.hex(),
        "span": span.span_id.hex(),
        "parent": span.parent_span_id.hex(),
        "start_ns": span.start_time_unix_nano,
        "end_ns": span.end_time_unix_nano,
        "attributes": {k: v for k, v in attributes.items() if isinstance(v, str | int | float)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4317)
    parser.add_argument("--out", default=None, help="where the counts go (default: stdout)")
    parser.add_argument("--spans", default=None, help="a JSON-lines file for every span")
    args = parser.parse_args(argv)
    spans_out = open(args.spans, "w") if args.spans else None  # noqa: SIM115 (closed below)
    service = _CountingService(spans_out)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    if server.add_insecure_port(f"{args.host}:{args.port}") == 0:
        print(f"cannot listen on {args.host}:{args.port}", file=sys.stderr)
        return 2
    server.start()
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=1).wait()
    if spans_out is not None:
        spans_out.close()
    counts = json.dumps({"spans": service.spans, "traces": len(service.trace_ids)})
    if args.out:
        with open(args.out, "w") as out:
            out.write(counts + "\n")
    else:
        print(counts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
