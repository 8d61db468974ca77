"""The gateway's part of a request's trace: its HTTP server span and what it says.

The server span comes from OpenTelemetry's FastAPI instrumentation (an incoming W3C
`traceparent` becomes its parent); its trace id goes back to the client in `x-trace-id`, the id
to search for in Jaeger. The endpoints describe the request on that span with the OpenTelemetry
GenAI semantic conventions; the request flow adds child spans for routing and the decode
reservation and passes the context to the workers in gRPC metadata.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI
from opentelemetry import trace
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nori.sampling.params import SamplingParams
from nori.telemetry.tracing import Tracing

TRACE_ID_HEADER = "x-trace-id"
# gen_ai.provider.name: this server (the conventions' list names the hosted APIs).
PROVIDER_NAME = "nori"


def instrument(app: FastAPI, tracing: Tracing, untraced_paths: Sequence[str]) -> None:
    """Server spans for `app` when tracing is on (nothing at all when it is off)."""
    if not tracing.enabled:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    app.add_middleware(TraceIdHeaderMiddleware)
    FastAPIInstrumentor.instrument_app(
        app,
        tracer_provider=tracing.provider,
        # A span per SSE chunk sent would cost more than the chunk.
        exclude_spans=["receive", "send"],
        excluded_urls=",".join(untraced_paths),
    )


class TraceIdHeaderMiddleware:
    """Puts the current trace's id in the response headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        context = trace.get_current_span().get_span_context()

        async def send_with_trace_id(message: Message) -> None:
            if message["type"] == "http.response.start" and context.is_valid:
                headers = list(message.get("headers", []))
                headers.append(
                    (TRACE_ID_HEADER.encode(), trace.format_trace_id(context.trace_id).encode())
                )
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_trace_id)


def describe_request(
    operation: str, model: str, params: SamplingParams, response_id: str
) -> trace.Span:
    """Sets the GenAI request attributes on the current (server) span and returns it."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(
            {
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": PROVIDER_NAME,
                "gen_ai.request.model": model,
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.response.id": response_id,
            }
        )
    return span
