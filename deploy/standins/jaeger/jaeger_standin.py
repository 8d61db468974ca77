"""A stand-in for jaegertracing/all-in-one where Docker Hub cannot be reached (compose-check.sh).

It receives OTLP/gRPC on :4317, as Jaeger's collector does (bench/otlp_sink.py's approach: the
TraceService's Export method, decoded with opentelemetry-proto's messages), keeps the spans in
memory (the newest traces, up to --max-spans spans), and answers on :16686 the part of Jaeger's
query API that compose-check.sh reads, with the same JSON shape:

    GET /api/services              {"data": ["nori-gateway", ...]}
    GET /api/traces/{traceID}      {"data": [{"traceID", "spans": [...], "processes": {...}}]}
    GET /api/traces?service=S&limit=N
    GET /                          a plain-text note that this is a stand-in

Each span: traceID, spanID, operationName, references (CHILD_OF its parent), startTime and
duration in microseconds, tags, processID; processes[processID].serviceName is its service.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import signal
import threading
from concurrent import futures
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class Store:
    """Received spans by trace id (hex), the oldest traces dropped past max_spans."""

    def __init__(self, max_spans: int) -> None:
        self.lock = threading.Lock()
        self.traces: collections.OrderedDict[str, list[dict[str, Any]]] = collections.OrderedDict()
        self.spans = 0
        self.max_spans = max_spans

    def add(self, service: str, span: Any) -> None:
        record = _span_record(service, span)
        with self.lock:
            self.traces.setdefault(record["traceID"], []).append(record)
            self.spans += 1
            while self.spans > self.max_spans and len(self.traces) > 1:
                _, dropped = self.traces.popitem(last=False)
                self.spans -= len(dropped)

    def trace(self, trace_id: str) -> list[dict[str, Any]] | None:
        with self.lock:
            spans = self.traces.get(trace_id.lower().rjust(32, "0"))
            return list(spans) if spans is not None else None

    def services(self) -> list[str]:
        with self.lock:
            return sorted({s["service"] for spans in self.traces.values() for s in spans})

    def find(self, service: str | None, limit: int) -> list[tuple[str, list[dict[str, Any]]]]:
        with self.lock:
            found = []
            for trace_id, spans in reversed(self.traces.items()):
                if service is None or any(s["service"] == service for s in spans):
                    found.append((trace_id, list(spans)))
                    if len(found) >= limit:
                        break
            return found


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    value = getattr(any_value, kind) if kind else None
    return value if isinstance(value, str | int | float | bool) else str(value)


def _span_record(service: str, span: Any) -> dict[str, Any]:
    start_us = span.start_time_unix_nano // 1000
    return {
        "service": service,
        "traceID": span.trace_id.hex(),
        "spanID": span.span_id.hex(),
        "parentSpanID": span.parent_span_id.hex(),
        "operationName": span.name,
        "startTime": start_us,
        "duration": max(0, span.end_time_unix_nano // 1000 - start_us),
        "tags": [{"key": a.key, "value": _value(a.value)} for a in span.attributes],
    }


def _jaeger_trace(trace_id: str, spans: list[dict[str, Any]]) -> dict[str, Any]:
    """One trace in Jaeger's query JSON: spans point at processes by processID."""
    process_ids: dict[str, str] = {}
    out = []
    for s in spans:
        pid = process_ids.setdefault(s["service"], f"p{len(process_ids) + 1}")
        refs = (
            [{"refType": "CHILD_OF", "traceID": trace_id, "spanID": s["parentSpanID"]}]
            if s["parentSpanID"]
            else []
        )
        out.append(
            {
                "traceID": trace_id,
                "spanID": s["spanID"],
                "operationName": s["operationName"],
                "references": refs,
                "startTime": s["startTime"],
                "duration": s["duration"],
                "tags": s["tags"],
                "logs": [],
                "processID": pid,
                "warnings": None,
            }
        )
    processes = {pid: {"serviceName": name, "tags": []} for name, pid in process_ids.items()}
    return {"traceID": trace_id, "spans": out, "processes": processes, "warnings": None}


def _export_handler(store: Store) -> grpc.GenericRpcHandler:
    def export(request: Any, context: grpc.ServicerContext) -> Any:
        for resource_spans in request.resource_spans:
            service = next(
                (
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                ),
                "unknown_service",
            )
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    store.add(service, span)
        return trace_service_pb2.ExportTraceServiceResponse()

    handler = grpc.unary_unary_rpc_method_handler(
        export,
        request_deserializer=trace_service_pb2.ExportTraceServiceRequest.FromString,
        response_serializer=trace_service_pb2.ExportTraceServiceResponse.SerializeToString,
    )

    class Handler(grpc.GenericRpcHandler):
        def service(self, handler_call_details: Any) -> Any:
            return handler if handler_call_details.method == EXPORT_METHOD else None

    return Handler()


def _query_handler(store: Store) -> type[BaseHTTPRequestHandler]:
    class Query(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _json(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            url = urlparse(self.path)
            query = parse_qs(url.query)
            match = re.fullmatch(r"/api/traces/([0-9a-fA-F]{1,32})", url.path)
            if match:
                spans = store.trace(match.group(1))
                if spans is None:
                    self._json(
                        404, {"data": None, "errors": [{"code": 404, "msg": "trace not found"}]}
                    )
                else:
                    trace_id = match.group(1).lower().rjust(32, "0")
                    self._json(200, {"data": [_jaeger_trace(trace_id, spans)], "errors": None})
            elif url.path == "/api/traces":
                service = query.get("service", [None])[0]
                limit = int(query.get("limit", ["20"])[0])
                data = [_jaeger_trace(t, s) for t, s in store.find(service, limit)]
                self._json(200, {"data": data, "errors": None})
            elif url.path == "/api/services":
                self._json(200, {"data": store.services(), "errors": None})
            elif url.path in ("/", "/search"):
                body = b"Jaeger stand-in (deploy/standins/jaeger): OTLP/gRPC on :4317, /api/traces/{id}\n"
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self._json(404, {"data": None, "errors": [{"code": 404, "msg": "not found"}]})

    return Query


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--otlp-port", type=int, default=4317)
    parser.add_argument("--query-port", type=int, default=16686)
    parser.add_argument("--max-spans", type=int, default=200_000)
    args = parser.parse_args(argv)
    store = Store(args.max_spans)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((_export_handler(store),))
    server.add_insecure_port(f"[::]:{args.otlp_port}")
    server.start()
    http = ThreadingHTTPServer(("0.0.0.0", args.query_port), _query_handler(store))
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, daemon=True).start()
    print(f"jaeger stand-in: OTLP/gRPC :{args.otlp_port}, query API :{args.query_port}", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    http.shutdown()
    server.stop(grace=1).wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
