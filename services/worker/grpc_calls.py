"""Engine operations from gRPC handlers: bad input ends the call with INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import grpc

from nori.engine.engine import LLMEngine
from nori.worker.engine_thread import EngineThread

T = TypeVar("T")


async def call_engine(
    engine: EngineThread, context: grpc.aio.ServicerContext, operation: Callable[[LLMEngine], T]
) -> T:
    """Runs `operation` on the engine thread. The engine raises ValueError only for input it can
    never serve (too long, ids out of range, a duplicate id): the caller's error, not ours."""
    try:
        return await engine.call(operation)
    except ValueError as error:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    raise AssertionError("unreachable: context.abort raises")
