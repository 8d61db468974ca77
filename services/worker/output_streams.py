"""Routes each engine step's outputs to the coroutine serving that request."""

from __future__ import annotations

import asyncio

from nori.engine.outputs import RequestOutput


async def next_output(queue: asyncio.Queue[RequestOutput]) -> RequestOutput:
    """The request's next output, merged with every further one already waiting.

    When the consumer falls behind (a busy event loop, a slow client), the steps it missed go
    out as one delta: one message and one send instead of one per token.
    """
    output = await queue.get()
    while not output.finished and not queue.empty():
        output = output.followed_by(queue.get_nowait())
    return output


class OutputStreams:
    """One queue per open request, filled on the event loop from EngineThread.on_outputs.

    A queue holds at most the request's own tokens (max_tokens bounds it); outputs for a request
    nobody waits for any more (its caller went away) are dropped.
    """

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}

    def open(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    def __len__(self) -> int:
        return len(self._queues)
