"""Routes each engine step's outputs to the coroutine serving that request, and turns them into
the wire's deltas."""

from __future__ import annotations

import asyncio
import contextlib

from nori.engine.outputs import StepOutput
from nori.rpc.convert import logprobs_to_proto
from nori.v1 import common_pb2


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


def delta_from_output(output: StepOutput) -> common_pb2.TokenDelta:
    """What one engine step added to a request, as a wire delta."""
    delta = common_pb2.TokenDelta(
        token_ids=output.new_token_ids,
        text=output.new_text,
        finished=output.finished,
        finish_reason=output.finish_reason or "",
        num_cached_tokens=output.num_cached_tokens,
    )
    if isinstance(output.stop_reason, str):
        delta.stop_string = output.stop_reason
    elif isinstance(output.stop_reason, int):
        delta.stop_token_id = output.stop_reason
    if output.logprobs is not None and output.new_token_ids:
        new = output.logprobs[-len(output.new_token_ids) :]
        delta.logprobs.extend(logprobs_to_proto(entry) for entry in new)
    if output.prompt_logprobs is not None and len(output.new_token_ids) == len(output.token_ids):
        # Once, with the first token(s): from then on the receiver has them.
        delta.prompt_logprobs.SetInParent()
        delta.prompt_logprobs.entries.extend(
            logprobs_to_proto(entry) for entry in output.prompt_logprobs[1:] if entry is not None
        )
    return delta
