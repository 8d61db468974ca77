"""vLLM's `priority` from the OpenAI body to the workers' calls: the body's field (an int32) on
every choice's GenerationRequest, and on the Generate and Prefill calls the request flow makes,
a migrated request's included."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from nori.gateway.backend import GenerationRequest
from nori.gateway.ledger import Ledger
from nori.gateway.prompts import COALESCE_MS
from nori.gateway.request_flow import RequestFlow, Resumed
from nori.sampling.params import SamplingParams
from nori.sampling.tokenizer import Tokenizer
from nori.settings import BATCH_PRIORITY
from nori.v1 import common_pb2, decode_pb2, prefill_pb2
from nori.v1.handoff_pb2 import KVDestination
from tests.gateway.app_helpers import assert_error, make_app, post
from tests.gateway.helpers import FakeBackend
from tests.gateway.test_prefill_slot import DECODE, PREFILL, NoCachedPrefixes

pytestmark = pytest.mark.asyncio

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", {"prompt": ["a", "b"], "n": 2}), ("/v1/chat/completions", CHAT)],
)
async def test_the_body_priority_reaches_every_choice(
    tokenizer: Tokenizer, path: str, body: dict[str, Any]
) -> None:
    backend = FakeBackend()
    app = make_app(tokenizer, backend)
    response = await post(app, path, {**body, "priority": BATCH_PRIORITY})
    assert response.status_code == 200, response.text
    assert backend.requests and {r.priority for r in backend.requests} == {BATCH_PRIORITY}
    backend.requests.clear()
    assert (await post(app, path, body)).status_code == 200
    assert {r.priority for r in backend.requests} == {0}  # interactive unless told


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_only_a_non_streamed_request_asks_for_coalesced_outputs_and_a_streamed_one_for_its_interval(
    tokenizer: Tokenizer, path: str
) -> None:
    backend = FakeBackend()
    app = make_app(tokenizer, backend, stream_interval=4)
    body = {"prompt": "a"} if path == "/v1/completions" else CHAT
    assert (await post(app, path, body)).status_code == 200
    assert {r.coalesce_ms for r in backend.requests} == {COALESCE_MS}
    assert {r.stream_interval for r in backend.requests} == {1}
    backend.requests.clear()
    assert (await post(app, path, {**body, "stream": True})).status_code == 200
    assert {r.coalesce_ms for r in backend.requests} == {0}
    # --stream-interval applies to streamed requests only.
    assert {r.stream_interval for r in backend.requests} == {4}


@pytest.mark.parametrize("priority", [2**31, -(2**31) - 1, "1", 1.5, None])
async def test_a_priority_that_is_no_int32_is_400(tokenizer: Tokenizer, priority: Any) -> None:
    response = await post(
        make_app(tokenizer), "/v1/chat/completions", {**CHAT, "priority": priority}
    )
    assert_error(response, 400, "priority")


# ----------------------------------------------------------------------- the worker calls


class FakeStreamCall:
    """A server stream that plays `messages`, then ends."""

    def __init__(self, messages: list[Message]) -> None:
        self._messages = list(messages)

    async def read(self) -> Any:
        await asyncio.sleep(0)
        return self._messages.pop(0) if self._messages else grpc.aio.EOF

    def cancel(self) -> bool:
        return True


class FakeUnaryCall:
    def __init__(self, answer: Message) -> None:
        self._answer = answer

    def __await__(self) -> Any:
        async def answer() -> Message:
            return self._answer

        return answer().__await__()

    def cancel(self) -> bool:
        return True


@dataclass
class RecordingChannel:
    """A channel whose calls record their request and answer with what the test scripted."""

    stream: list[Message]
    answer: Message = field(default_factory=prefill_pb2.PrefillResponse)
    sent: list[Message] = field(default_factory=list)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        def call(request: Message, metadata: Any = None) -> FakeStreamCall:
            self.sent.append(request)
            return FakeStreamCall(self.stream)

        return call

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        def call(request: Message, metadata: Any = None) -> FakeUnaryCall:
            self.sent.append(request)
            return FakeUnaryCall(self.answer)

        return call


class Pool:
    """The worker pool as RequestFlow sees it: one prefill worker, every address one channel."""

    block_size = 16

    def __init__(self, channel: RecordingChannel) -> None:
        self._channel = channel

    def available(self, role: str) -> list[Any]:
        return [PREFILL] if role == "prefill" else []

    def channel(self, address: str) -> RecordingChannel:
        return self._channel


def delta(token: int, finished: bool = False) -> common_pb2.TokenDelta:
    return common_pb2.TokenDelta(
        token_ids=[token], text="x", finished=finished, finish_reason="length" if finished else ""
    )


REQUEST = GenerationRequest("r-1", [1, 2, 3], SamplingParams(max_tokens=2), priority=7)


async def test_the_disaggregated_calls_carry_the_priority() -> None:
    reservation = KVDestination(worker_id=DECODE.worker_id, block_ids=[0], lease_seconds=5.0)
    channel = RecordingChannel(
        stream=[
            decode_pb2.GenerateResponse(reservation=reservation),
            decode_pb2.GenerateResponse(delta=delta(8, finished=True)),
        ],
        answer=prefill_pb2.PrefillResponse(first=delta(7)),
    )
    ledger = Ledger()
    flow = RequestFlow(Pool(channel), ledger, NoCachedPrefixes(), None)  # type: ignore[arg-type]
    request = dataclasses.replace(REQUEST, stream_interval=3)
    ticket = ledger.admit(request, 1, 0.0)
    chunks = [c async for c in flow.serve_disaggregated(request, DECODE, ticket)]
    assert [c.new_token_ids for c in chunks] == [[7], [8]]
    generate, prefill = channel.sent
    assert isinstance(generate, decode_pb2.GenerateRequest) and generate.priority == 7
    assert generate.coalesce_ms == 0  # a streamed request's tokens as they come
    assert generate.stream_interval == 3
    assert isinstance(prefill, prefill_pb2.PrefillRequest) and prefill.priority == 7


async def test_a_migrated_request_keeps_its_priority() -> None:
    channel = RecordingChannel(stream=[decode_pb2.GenerateResponse(delta=delta(9, finished=True))])
    ledger = Ledger()
    flow = RequestFlow(Pool(channel), ledger, NoCachedPrefixes(), None)  # type: ignore[arg-type]
    resumed = Resumed([7, 8], num_chars=2)
    ticket = ledger.admit(REQUEST, 1, 0.0)
    chunks = [c async for c in flow.compute_and_decode(REQUEST, DECODE, ticket, resumed)]
    assert [c.new_token_ids for c in chunks] == [[9]]
    (generate,) = channel.sent
    assert isinstance(generate, decode_pb2.GenerateRequest)
    assert generate.compute_prompt and list(generate.resumed_output_token_ids) == [7, 8]
    assert generate.priority == 7
