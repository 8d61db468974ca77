"""Engine operations from gRPC handlers: bad input ends the call with INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from nori.worker.engine_core import EngineCore

T = TypeVar("T")


async def call_engine(
    engine: EngineCore,
    context: grpc.aio.ServicerContext,
    function: Callable[..., T],
    *args: Any,
    **kwargs: Any,
) -> T:
    """Runs `function(engine, *args, **kwargs)` in the engine loop. The engine raises ValueError
    only for input it can never serve (too long, ids out of range, a duplicate id): the caller's
    error, not ours."""
    try:
        return await engine.call(function, *args, **kwargs)
    except ValueError as error:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    raise AssertionError("unreachable: context.abort raises")
