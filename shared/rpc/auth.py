"""Workers accept internal gRPC calls only from holders of the cluster secret.

Every internal call carries `ClusterAuth.rpc_token()` in its metadata; `ClusterTokenInterceptor`
answers a missing or wrong one UNAUTHENTICATED before any handler runs. The health service stays
open; an open cluster installs no interceptor."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from nori.cluster_auth import RPC_TOKEN_METADATA, ClusterAuth

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)

DENIED_MESSAGE = (
    "this Nori worker takes internal calls only with the cluster's credential (metadata "
    f"{RPC_TOKEN_METADATA!r}, derived from --cluster-secret / NORI_CLUSTER_SECRET): missing or wrong"
)


def call_token(metadata: tuple[Any, ...] | None) -> str | None:
    for key, value in metadata or ():
        if key == RPC_TOKEN_METADATA:
            return value if isinstance(value, str) else None
    return None


async def _deny(request_or_iterator: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED_MESSAGE)


def denying_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind (gRPC needs it) that only aborts with UNAUTHENTICATED."""
    options: dict[str, Any] = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny, **options)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny, **options)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny, **options)
    return grpc.unary_unary_rpc_method_handler(_deny, **options)


class ClusterTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but the health service's without this cluster's token."""

    def __init__(self, auth: ClusterAuth) -> None:
        if not auth.enabled:
            raise ValueError("an open cluster checks no tokens (install no interceptor)")
        self._auth = auth

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        token = call_token(handler_call_details.invocation_metadata)
        if self._auth.check_rpc_token(token):
            return handler
        return denying_handler(handler)


def server_interceptors(auth: ClusterAuth) -> tuple[grpc.aio.ServerInterceptor, ...]:
    return (ClusterTokenInterceptor(auth),) if auth.enabled else ()
