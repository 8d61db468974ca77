"""The workers' token check (nori.rpc.auth) on a real grpc.aio server, for every kind of method."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from nori.cluster_auth import RPC_TOKEN_METADATA, ClusterAuth, generate_secret
from nori.rpc.auth import ClusterTokenInterceptor, call_token, server_interceptors

AUTH = ClusterAuth.from_text(generate_secret())
SERVICE = "nori.test.Echo"


async def unary_unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return b"uu:" + request


async def unary_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    for index in range(3):
        yield b"us%d:" % index + request


async def stream_unary(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
    return b"su:" + b"".join([request async for request in requests])


async def stream_stream(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
) -> AsyncIterator[bytes]:
    async for request in requests:
        yield b"ss:" + request


HANDLERS = grpc.method_handlers_generic_handler(
    SERVICE,
    {
        "UU": grpc.unary_unary_rpc_method_handler(unary_unary),
        "US": grpc.unary_stream_rpc_method_handler(unary_stream),
        "SU": grpc.stream_unary_rpc_method_handler(stream_unary),
        "SS": grpc.stream_stream_rpc_method_handler(stream_stream),
    },
)


async def start_server(auth: ClusterAuth) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=server_interceptors(auth))
    server.add_generic_rpc_handlers((HANDLERS,))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, f"127.0.0.1:{port}"


async def requests() -> AsyncIterator[bytes]:
    for part in (b"a", b"b"):
        yield part


def callers(channel: grpc.aio.Channel) -> dict[str, Callable[[Any, bool], Any]]:
    """Each kind of call with the given metadata: `send` sends its requests (streams of them
    too) and reads the answer to its end; otherwise it only opens the call, sending no request
    a client-streaming one (its status is what a denied caller sees)."""

    async def read(call: Any) -> list[bytes]:
        return [message async for message in call]

    path = f"/{SERVICE}/"
    uu, us = channel.unary_unary(path + "UU"), channel.unary_stream(path + "US")
    su, ss = channel.stream_unary(path + "SU"), channel.stream_stream(path + "SS")
    return {
        "UU": lambda md, send: uu(b"x", metadata=md),
        "US": lambda md, send: read(us(b"x", metadata=md)) if send else us(b"x", metadata=md),
        "SU": lambda md, send: su(requests(), metadata=md) if send else su(metadata=md),
        "SS": lambda md, send: read(ss(requests(), metadata=md)) if send else ss(metadata=md),
    }


EXPECTED = {"UU": b"uu:x", "US": [b"us0:x", b"us1:x", b"us2:x"], "SU": b"su:ab"}
EXPECTED["SS"] = [b"ss:a", b"ss:b"]


async def test_every_kind_of_call_needs_the_token_and_health_does_not() -> None:
    server, address = await start_server(AUTH)
    wrong = ((RPC_TOKEN_METADATA, ClusterAuth.from_text(generate_secret()).rpc_token()),)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            for kind, call in callers(channel).items():
                for metadata in ((), wrong, ((RPC_TOKEN_METADATA, ""),), (("other", "x"),)):
                    opened = call(metadata, False)
                    # A denied stream ends at once; a hang would time out here instead.
                    code = await asyncio.wait_for(opened.code(), 5)
                    assert code == grpc.StatusCode.UNAUTHENTICATED, kind
                    assert RPC_TOKEN_METADATA in (await opened.details() or "")
                assert await call(AUTH.rpc_metadata(), True) == EXPECTED[kind], kind
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest()
            )
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await channel.unary_unary("/nori.test.Echo/Missing")(b"x")
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(None)


async def test_an_open_cluster_checks_nothing() -> None:
    assert server_interceptors(ClusterAuth.open()) == ()
    with pytest.raises(ValueError, match="open cluster"):
        ClusterTokenInterceptor(ClusterAuth.open())
    server, address = await start_server(ClusterAuth.open())
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            for kind, call in callers(channel).items():
                assert await call((), True) == EXPECTED[kind], kind
    finally:
        await server.stop(None)


def test_call_token_reads_the_metadata() -> None:
    assert call_token(None) is None and call_token((("a", "b"),)) is None
    assert call_token(((RPC_TOKEN_METADATA, "t"),)) == "t"
    assert call_token(((RPC_TOKEN_METADATA, b"t"),)) is None  # binary values are not tokens
