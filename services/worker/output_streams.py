"""Routes each engine step's outputs to the request's coroutine, and turns them into deltas."""

from __future__ import annotations

import asyncio
import contextlib

from nori.engine.outputs import StepOutput
from nori.rpc.convert import logprobs_to_proto
from nori.v1 import common_pb2


async def next_output(queue: asyncio.Queue[StepOutput]) -> StepOutput:
    """The request's next output, merged with every further one already waiting (a slow
    consumer gets one delta for the steps it missed)."""
    output = await queue.get()
    while not output.finished and not queue.empty():
        output = output.followed_by(queue.get_nowait())
    return output


async def next_output_of(queue: asyncio.Queue[StepOutput], num_tokens: int) -> StepOutput:
    """The next outputs merged until they hold `num_tokens` new tokens, or the last is in."""
    output = await next_output(queue)
    while not output.finished and len(output.new_token_ids) < num_tokens:
        output = output.followed_by(await next_output(queue))
    return output


class OutputQueue(asyncio.Queue[StepOutput]):
    def __init__(self) -> None:
        super().__init__()
        self.finished = asyncio.Event()


async def next_output_coalesced(queue: OutputQueue, interval_s: float) -> StepOutput:
    """The next output merged with every further one for `interval_s`, or until it finishes;
    the consumer sleeps meanwhile (one wake-up per interval, not per step)."""
    output = await next_output(queue)
    if not output.finished:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(interval_s):
                await queue.finished.wait()
        while not output.finished and not queue.empty():
            output = output.followed_by(queue.get_nowait())
    return output


class OutputStreams:
    """One queue per open request, filled on the event loop; outputs for a request nobody waits
    for any more are dropped.
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
        delta.prompt_logprobs.SetInParent()
        delta.prompt_logprobs.entries.extend(
            logprobs_to_proto(entry) for entry in output.prompt_logprobs[1:] if entry is not None
        )
    return delta
