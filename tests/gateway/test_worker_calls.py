"""How the gateway reads a worker's stream: a stream that stalls is a lost worker, with the
request moved on, not a wait without end; a call's end and its messages pass through."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from nori.gateway.errors import WorkerLostError
from nori.gateway.request_flow import read


class _Call:
    """A stream call that answers each read() with the next scripted item (None: never)."""

    def __init__(self, *items: object) -> None:
        self._items = list(items)

    async def read(self) -> object:
        item = self._items.pop(0)
        if item is None:
            await asyncio.Event().wait()  # a worker that never sends again
        return item


def test_a_stalled_stream_is_a_lost_worker_after_the_timeout() -> None:
    async def scenario() -> None:
        call = _Call("first", None)
        assert await read(call, "decode-0", stall_timeout_s=0.2) == "first"  # type: ignore[arg-type]
        started = asyncio.get_running_loop().time()
        with pytest.raises(WorkerLostError, match=r"decode-0 sent nothing for 0.2 s"):
            await read(call, "decode-0", stall_timeout_s=0.2)  # type: ignore[arg-type]
        assert 0.15 < asyncio.get_running_loop().time() - started < 2.0

    asyncio.run(scenario())


def test_the_end_of_a_stream_is_none() -> None:
    async def scenario() -> None:
        call = _Call(grpc.aio.EOF)
        assert await read(call, "decode-0", stall_timeout_s=1.0) is None  # type: ignore[arg-type]

    asyncio.run(scenario())
