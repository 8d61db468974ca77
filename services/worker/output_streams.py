"""Routes each engine step's outputs to the coroutine serving that request."""

from __future__ import annotations

import asyncio
import contextlib

from nori.engine.outputs import StepOutput


async def next_output(queue: asyncio.Queue[StepOutput]) -> StepOutput:
    """The request's next output, merged with every further one already waiting.

    When the consumer falls behind (a busy event loop, a slow client), the steps it missed go
    out as one delta: one message and one send instead of one per token.
    """
    output = await queue.get()
    while not output.finished and not queue.empty():
        output = output.followed_by(queue.get_nowait())
    return output


async def next_output_of(queue: asyncio.Queue[StepOutput], num_tokens: int) -> StepOutput:
    """The request's next outputs merged until they hold at least `num_tokens` new tokens, or
    the last one is in: one message per `num_tokens` tokens (--stream-interval)."""
    output = await next_output(queue)
    while not output.finished and len(output.new_token_ids) < num_tokens:
        output = output.followed_by(await next_output(queue))
    return output


class OutputQueue(asyncio.Queue[StepOutput]):
    """One request's outputs, and whether its last one is in (`finished`)."""

    def __init__(self) -> None:
        super().__init__()
        self.finished = asyncio.Event()


async def next_output_coalesced(queue: OutputQueue, interval_s: float) -> StepOutput:
    """The request's next output merged with every further one for `interval_s`, or until it
    finishes: one message per interval for a caller that needs only the whole completion.

    Between its first output and the end of the interval the consumer sleeps: the steps' outputs
    pile up in the queue without waking it (one wake-up per interval, not per step: with
    hundreds of rows, per-step wake-ups take the event loop, and the GIL, from the engine)."""
    output = await next_output(queue)
    if not output.finished:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(interval_s):
                await queue.finished.wait()
        while not output.finished and not queue.empty():
            output = output.followed_by(queue.get_nowait())
    return output


class OutputStreams:
    """One queue per open request, filled on the event loop from EngineThread.on_outputs.

    A queue holds at most the request's own tokens (max_tokens bounds it); outputs for a request
    nobody waits for any more (its caller went away) are dropped.
    """

    def __init__(self) -> None:
        self._queues: dict[str, OutputQueue] = {}

    def open(self, request_id: str) -> OutputQueue:
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue = OutputQueue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def dispatch(self, outputs: list[StepOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
                if output.finished:
                    queue.finished.set()

    def __len__(self) -> int:
        return len(self._queues)
