"""The decode and prefill servicers hand the call's `priority` to the engine: on a computed
prompt (colocated, or a migrated request), on a reservation, and on a prefill."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import pytest

from nori.decode.servicer import DecodeServicer
from nori.engine.outputs import StepOutput
from nori.engine.request import KVFromRemote, NoFreeBlocks, RemoteKV
from nori.prefill.servicer import PrefillServicer
from nori.rpc.convert import params_to_proto
from nori.sampling.params import SamplingParams
from nori.telemetry.tracing import Tracing
from nori.v1 import decode_pb2, prefill_pb2
from nori.worker.request_telemetry import WorkerTelemetry
from nori.worker.servicer_base import OutputStreams
from nori.worker.worker_metrics import WorkerMetrics

pytestmark = pytest.mark.asyncio
PARAMS = params_to_proto(SamplingParams(max_tokens=1))


class RecordingEngine:
    """Records the priority each operation got; a queued request ends with its first token."""

    def __init__(self, streams: OutputStreams) -> None:
        self._streams = streams
        self.calls: list[tuple[str, int]] = []

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        remote_kv: RemoteKV | None = None,
        output_token_ids: Sequence[int] = (),
        num_emitted_chars: int = 0,
    ) -> list[int]:
        if isinstance(remote_kv, KVFromRemote):
            self.calls.append(("reserve", priority))
            raise NoFreeBlocks("no room, even for it")
        self.calls.append(("add_request", priority))
        output = StepOutput(request_id, prompt, [5], "x", [5], "x", True, "length")
        self._streams.dispatch([output])
        return []

    def abort_request(self, request_id: str) -> None:
        pass


class EngineThread:
    """Runs operations at once, on the caller's thread: an LLMEngine method the servicer names
    runs as the recording engine's method of that name."""

    def __init__(self, engine: RecordingEngine) -> None:
        self.engine = engine

    async def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return getattr(self.engine, function.__name__)(*args, **kwargs)

    def submit(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        getattr(self.engine, function.__name__)(*args, **kwargs)


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code)

    def invocation_metadata(self) -> tuple[()]:
        return ()


class AnySink:
    def forget(self, request_id: str) -> None:
        pass


class Leases:
    def hold(self, *args: Any) -> None:
        pass

    def started(self, request_ids: list[str]) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass


def telemetry() -> WorkerTelemetry:
    return WorkerTelemetry(WorkerMetrics(), Tracing.off(), "w")


def decode_servicer(sink: AnySink | None) -> tuple[DecodeServicer, RecordingEngine]:
    streams = OutputStreams()
    engine = RecordingEngine(streams)
    servicer = DecodeServicer(
        "decode-0",
        EngineThread(engine),  # type: ignore[arg-type]
        streams,
        sink,  # type: ignore[arg-type]
        None,
        "tcp://127.0.0.1:1",
        5.0,
        lambda: False,
        telemetry(),
        8,
    )
    return servicer, engine


def prefill_servicer(
    engine_class: type[RecordingEngine] = RecordingEngine,
    max_open_calls: int = 8,
    max_background_calls: int | None = None,
) -> tuple[PrefillServicer, RecordingEngine]:
    streams = OutputStreams()
    engine = engine_class(streams)
    servicer = PrefillServicer(
        "prefill-0",
        EngineThread(engine),  # type: ignore[arg-type]
        streams,
        None,  # type: ignore[arg-type]
        lambda: False,
        Leases(),  # type: ignore[arg-type]
        telemetry(),
        max_open_calls,
        max_background_calls,
    )
    return servicer, engine


async def test_generate_passes_the_priority_to_the_engine() -> None:
    servicer, engine = decode_servicer(sink=None)
    request = decode_pb2.GenerateRequest(
        request_id="r",
        prompt_token_ids=[1, 2],
        params=PARAMS,
        compute_prompt=True,
        resumed_output_token_ids=[3],
        priority=1000,
    )
    responses = [response async for response in servicer.Generate(request, Context())]  # type: ignore[arg-type]
    assert [r.delta.token_ids for r in responses] == [[5]]
    assert engine.calls == [("add_request", 1000)]


async def test_a_reservation_carries_the_priority() -> None:
    servicer, engine = decode_servicer(sink=AnySink())
    request = decode_pb2.GenerateRequest(
        request_id="r", prompt_token_ids=[1, 2], params=PARAMS, priority=-3
    )
    with pytest.raises(Aborted) as aborted:
        async for _ in servicer.Generate(request, Context()):  # type: ignore[arg-type]
            pass
    assert aborted.value.args == (grpc.StatusCode.RESOURCE_EXHAUSTED,)
    assert engine.calls == [("reserve", -3)]


async def test_prefill_passes_the_priority_to_the_engine() -> None:
    servicer, engine = prefill_servicer()
    request = prefill_pb2.PrefillRequest(
        request_id="r", prompt_token_ids=[1, 2], params=PARAMS, priority=7
    )
    response = await servicer.Prefill(request, Context())  # type: ignore[arg-type]
    assert response.first.finished and list(response.first.token_ids) == [5]
    assert engine.calls == [("add_request", 7)]


class HoldingEngine(RecordingEngine):
    """Queues every request; `finish` ends one with its first token."""

    def add_request(
        self, request_id: str, prompt: list[int], *args: Any, **kwargs: Any
    ) -> list[int]:
        self.calls.append(("add_request", kwargs.get("priority", 0)))
        return []

    def finish(self, request_id: str) -> None:
        output = StepOutput(request_id, [1, 2], [5], "x", [5], "x", True, "length")
        self._streams.dispatch([output])


async def test_background_calls_leave_the_prefill_queue_to_interactive_ones() -> None:
    servicer, engine = prefill_servicer(HoldingEngine, max_open_calls=4, max_background_calls=2)
    assert isinstance(engine, HoldingEngine)

    def call(request_id: str, priority: int) -> asyncio.Task[Any]:
        request = prefill_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=[1, 2], params=PARAMS, priority=priority
        )
        return asyncio.ensure_future(servicer.Prefill(request, Context()))  # type: ignore[arg-type]

    async def refused(request_id: str, priority: int) -> None:
        with pytest.raises(Aborted) as aborted:
            await call(request_id, priority)
        assert aborted.value.args == (grpc.StatusCode.RESOURCE_EXHAUSTED,)

    batch = [call("b0", 1), call("b1", 1)]
    await asyncio.sleep(0)
    await refused("b2", 1)  # the batch's share of the worker is taken
    # Interactive calls count against each other only: the batch queued here takes none of
    # their room (the engine runs them first anyway).
    interactive = [call(f"i{i}", 0) for i in range(4)]
    await asyncio.sleep(0)
    await refused("i4", 0)  # max_open_calls interactive calls: full for interactive work
    assert servicer.num_active_requests == 6
    engine.finish("b0")  # a background call ends, but the open calls are still past the limit
    assert (await batch[0]).first.finished
    await refused("b3", 1)
    for request_id in ("i0", "i1", "i2"):
        engine.finish(request_id)
    await asyncio.gather(*interactive[:3])
    taken = call("b4", 1)  # 3 open calls now: a background slot again
    await asyncio.sleep(0)
    assert not taken.done()
    for request_id in ("b1", "b4", "i3"):
        engine.finish(request_id)
    await asyncio.gather(batch[1], taken, interactive[3])
    assert servicer.num_active_requests == 0
    assert [priority for _, priority in engine.calls] == [1, 1, 0, 0, 0, 0, 1]
