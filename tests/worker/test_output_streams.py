"""Outputs that are ready together leave a worker as one delta."""

from __future__ import annotations

import asyncio

import pytest

from nori.engine.outputs import StepOutput
from nori.worker.servicer_base import (
    OutputStreams,
    next_output,
    next_output_coalesced,
    next_output_of,
)


def _output(step: int, finished: bool = False) -> StepOutput:
    """Step `step` of request r: one new token (10 + step) and its text."""
    tokens = [10 + i for i in range(step + 1)]
    return StepOutput(
        request_id="r",
        prompt_token_ids=[1, 2],
        token_ids=tokens,
        text="".join(f"t{t}" for t in tokens),
        new_token_ids=[tokens[-1]],
        new_text=f"t{tokens[-1]}",
        finished=finished,
        finish_reason="length" if finished else None,
    )


async def test_waiting_outputs_are_merged_up_to_the_finished_one() -> None:
    streams = OutputStreams()
    queue = streams.open("r")
    streams.dispatch([_output(0)])
    first = await next_output(queue)
    assert first.new_token_ids == [10]
    # The consumer fell behind by three steps, the last of which finished the request.
    streams.dispatch([_output(1)])
    streams.dispatch([_output(2)])
    streams.dispatch([_output(3, finished=True)])
    merged = await next_output(queue)
    assert merged.new_token_ids == [11, 12, 13] and merged.new_text == "t11t12t13"
    assert merged.finished and merged.finish_reason == "length"
    assert merged.token_ids == [10, 11, 12, 13] and queue.empty()


async def test_nothing_waits_for_outputs_that_are_not_there_yet() -> None:
    streams = OutputStreams()
    queue = streams.open("r")
    streams.dispatch([_output(0)])
    assert (await next_output(queue)).new_token_ids == [10]
    getter = asyncio.ensure_future(next_output(queue))
    await asyncio.sleep(0.01)
    assert not getter.done()
    streams.dispatch([_output(1)])
    assert (await getter).new_token_ids == [11]


def test_outputs_of_different_requests_do_not_merge() -> None:
    other = StepOutput("s", [1], [5], "x", [5], "x", False)
    with pytest.raises(ValueError, match="cannot merge"):
        _output(0).followed_by(other)


async def test_coalesced_outputs_leave_once_per_interval_or_at_the_end() -> None:
    streams = OutputStreams()
    queue = streams.open("r")

    async def produce(steps: range, finish_at: int | None) -> None:
        for step in steps:
            await asyncio.sleep(0.01)
            streams.dispatch([_output(step, finished=step == finish_at)])

    producer = asyncio.ensure_future(produce(range(30), None))
    first = await next_output_coalesced(queue, 0.15)
    # Many steps in one message, not one message per step, and not all of them.
    assert 5 <= len(first.new_token_ids) < 30 and not first.finished
    await producer
    producer = asyncio.ensure_future(produce(range(30, 35), 34))
    started = asyncio.get_running_loop().time()
    last = await next_output_coalesced(queue, 10.0)
    # The end does not wait for the interval, and nothing is lost or repeated.
    assert last.finished and asyncio.get_running_loop().time() - started < 5
    assert first.new_token_ids + last.new_token_ids == list(range(10, 45))
    await producer


async def test_a_stream_interval_sends_that_many_tokens_a_message_and_the_rest_at_the_end() -> None:
    streams = OutputStreams()
    queue = streams.open("r")

    async def produce(steps: range, finish_at: int) -> None:
        for step in steps:
            await asyncio.sleep(0.002)
            streams.dispatch([_output(step, finished=step == finish_at)])

    producer = asyncio.ensure_future(produce(range(10), finish_at=9))
    outputs = [await next_output_of(queue, 4)]
    while not outputs[-1].finished:
        outputs.append(await next_output_of(queue, 4))
    await producer
    sizes = [len(output.new_token_ids) for output in outputs]
    tokens = [token for output in outputs for token in output.new_token_ids]
    assert sizes == [4, 4, 2] and tokens == list(range(10, 20))
    assert outputs[-1].finish_reason == "length"
    # A consumer that fell behind sends what waits, past the interval.
    streams.dispatch([_output(step) for step in range(10, 16)])
    assert len((await next_output_of(queue, 4)).new_token_ids) == 6
