"""An OTLP/gRPC trace receiver that counts what it is sent: the collector for measuring what
tracing costs (`bench/serving_suite.sh tracing`) where no Jaeger runs.

    python -m nori.bench.otlp_sink --port 4317 [--out spans.json]

On SIGINT or SIGTERM it writes {"spans": N, "traces": M} to --out (or stdout) and exits.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class _CountingService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans = 0
        self.trace_ids: set[bytes] = set()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans += 1
                        self.trace_ids.add(span.trace_id)
        return trace_service_pb2.ExportTraceServiceResponse()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4317)
    parser.add_argument("--out", default=None, help="where the counts go (default: stdout)")
    args = parser.parse_args(argv)
    service = _CountingService()
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
    counts = json.dumps({"spans": service.spans, "traces": len(service.trace_ids)})
    if args.out:
        with open(args.out, "w") as out:
            out.write(counts + "\n")
    else:
        print(counts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
