"""LocalEngineBackend on its own: streaming, abort on close, bounded queue, shutdown, idling."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from nori.engine.llm import LLM
from nori.gateway.backend import GenerationChunk, GenerationRequest
from nori.gateway.errors import BackendError, InvalidRequestError, QueueFullError
from nori.sampling.params import SamplingParams
from tests.gateway.local_backend import LocalEngineBackend

pytestmark = pytest.mark.asyncio

OPTIONS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 8,
    "num_kv_blocks": 64,
    "max_model_len": 128,
}
PROMPT = [0, 40, 41, 42, 43, 44]


def make_backend(checkpoint: Path, **overrides: Any) -> LocalEngineBackend:
    queued = overrides.pop("max_queued_requests", 16)
    return LocalEngineBackend.from_model(
        str(checkpoint), max_queued_requests=queued, **{**OPTIONS, **overrides}
    )


def request(request_id: str, max_tokens: int = 8, **params: Any) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
    return GenerationRequest(request_id, list(PROMPT), sampling)


async def collect(backend: LocalEngineBackend, req: GenerationRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in backend.generate(req)]


async def test_chunks_add_up_to_the_offline_output(tiny_checkpoint: Path) -> None:
    backend = make_backend(tiny_checkpoint)
    try:
        chunks, other = await asyncio.gather(
            collect(backend, request("a", 10, logprobs=2)), collect(backend, request("b", 4))
        )
    finally:
        await backend.close()
    expected = (
        LLM(str(tiny_checkpoint), **OPTIONS)
        .generate(
            [PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
        )[0]
        .outputs[0]
    )
    assert [t for c in chunks for t in c.new_token_ids] == expected.token_ids
    assert "".join(c.new_text for c in chunks) == expected.text
    # Logprobs are per chunk, one per new token, not the engine's running list.
    assert all(c.logprobs is not None and len(c.logprobs) == len(c.new_token_ids) for c in chunks)
    assert [e.token_id for c in chunks for e in c.logprobs or ()] == expected.token_ids
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].finish_reason == "length"
    assert sum(len(c.new_token_ids) for c in other) == 4


async def test_closing_the_iterator_aborts_and_frees_blocks(tiny_checkpoint: Path) -> None:
    backend = make_backend(tiny_checkpoint)
    engine = backend.engine
    aborted: list[str] = []
    abort = engine.abort_request

    def recording_abort(request_id: str) -> None:
        aborted.append(request_id)
        abort(request_id)

    engine.abort_request = recording_abort
    try:
        stream = backend.generate(request("long", 100))
        first = await anext(stream)
        assert first.new_token_ids and not first.finished
        await stream.aclose()
        deadline = time.monotonic() + 5
        while (
            aborted != ["long"] or engine.load().num_free_blocks != engine.load().num_total_blocks
        ):
            assert time.monotonic() < deadline, aborted
            await asyncio.sleep(0.01)
        # The backend serves on afterwards, and a request read to its end is never aborted.
        assert (await collect(backend, request("next", 3)))[-1].finished
        await asyncio.sleep(0.05)
        assert aborted == ["long"]
    finally:
        await backend.close()


async def test_a_full_queue_refuses_with_queue_full(tiny_checkpoint: Path) -> None:
    backend = make_backend(tiny_checkpoint, max_num_seqs=1, max_queued_requests=1)
    try:
        running = backend.generate(request("running", 100))
        waiting = backend.generate(request("waiting", 100))
        await anext(running)
        waiting_first = asyncio.ensure_future(anext(waiting))
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError) as refused:
            await collect(backend, request("refused"))
        assert refused.value.status_code == 429 and refused.value.retry_after_s > 0
        await running.aclose()
        assert (await waiting_first).new_token_ids  # admitted once the running one left
        await waiting.aclose()
        assert (await collect(backend, request("later", 2)))[-1].finished
    finally:
        await backend.close()


async def test_requests_the_engine_rejects_are_invalid(tiny_checkpoint: Path) -> None:
    backend = make_backend(tiny_checkpoint)
    try:
        too_long = GenerationRequest("x", [5] * 200, SamplingParams(max_tokens=1))
        with pytest.raises(InvalidRequestError, match="200 tokens"):
            await collect(backend, too_long)
        with pytest.raises(InvalidRequestError, match="out of range"):
            await collect(backend, GenerationRequest("y", [5, 99999], SamplingParams()))
        assert (await backend.health()).healthy
    finally:
        await backend.close()


async def test_close_ends_open_streams(tiny_checkpoint: Path) -> None:
    backend = make_backend(tiny_checkpoint)
    stream = backend.generate(request("open", 120))
    await anext(stream)
    await backend.close()
    with pytest.raises(BackendError, match="shutting down"):
        async for _ in stream:
            pass
    health = await backend.health()
    assert not health.healthy and "shut down" in health.detail
    with pytest.raises(BackendError, match="shut down"):
        await collect(backend, request("after"))
    await backend.close()  # idempotent


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
async def test_idle_engine_thread_sleeps(tiny_checkpoint: Path) -> None:
    backend = make_backend(tiny_checkpoint)
    try:
        await collect(backend, request("warm", 2))
        assert backend._thread is not None
        native_id = backend._thread.native_id

        def cpu_ticks() -> int:
            with open(f"/proc/self/task/{native_id}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])  # utime + stime

        before = cpu_ticks()
        await asyncio.sleep(0.5)
        # A busy loop would burn ~50 ticks (at 100 Hz) in half a second.
        assert cpu_ticks() - before <= 2
    finally:
        await backend.close()
