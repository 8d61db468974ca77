"""The engine core in its own process against the engine thread: the same tokens, errors that
reach the caller, a KV cache both sides see, and a dead engine process that fails its calls."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.engine.outputs import StepOutput
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.params import SamplingParams
from nori.worker.engine_core import (
    EngineCore,
    EngineCoreMode,
    resolve_engine_core,
    responsive,
    start_engine_core,
)
from nori.worker.engine_process import EngineProcess, EngineProcessDied
from nori.worker.servicer_base import OutputStreams, next_output

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint(tmp_path_factory.mktemp("engine-core-tiny"), "tiny", seed=11)


PROMPTS = [[0, 40, 41, 42, 43, 44], [0, 7, 8, 9], [0, 100, 3, 5, 11, 13, 17, 19, 23]]


def config(checkpoint: Path) -> EngineConfig:
    return EngineConfig(
        model=str(checkpoint), dtype="float32", block_size=8, num_kv_blocks=64, max_model_len=128
    )


async def generate(core: EngineCore, streams: OutputStreams, prompts: list[list[int]]) -> list[Any]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def one(index: int, prompt: list[int]) -> list[int]:
        request_id = f"r{index}"
        queue = streams.open(request_id)
        await core.call(LLMEngine.add_request, request_id, prompt, params)
        output: StepOutput = await next_output(queue)
        while not output.finished:
            output = await next_output(queue)
        streams.close(request_id)
        return output.token_ids

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def read_cache_value(engine: LLMEngine, index: int) -> float:
    return float(engine.kv_cache.tensors[0].flatten()[index])


def record_probe(engine: LLMEngine) -> int:
    return len(engine.load().running_request_ids)


async def test_process_core_generates_what_the_thread_core_does(tiny_checkpoint: Path) -> None:
    results: dict[EngineCoreMode, list[Any]] = {}
    probed: dict[EngineCoreMode, list[int]] = {}
    for mode in ("thread", "process"):
        streams = OutputStreams()
        probed[mode] = []
        core = await start_engine_core(
            mode,
            config(tiny_checkpoint),
            streams.dispatch,
            probe=record_probe,
            on_probe=probed[mode].append,
        )
        try:
            # The load is the engine's from the start (the registry and the router read it).
            assert core.load.num_total_blocks == core.load.num_free_blocks == 64
            results[mode] = await generate(core, streams, PROMPTS)
            # Bad input reaches the caller as the engine raised it, and the engine goes on.
            with pytest.raises(ValueError):
                await core.call(LLMEngine.add_request, "bad", [10**9], SamplingParams(max_tokens=2))
            assert await generate(core, streams, PROMPTS[:1]) == results[mode][:1]
            assert core.alive and responsive(core, 60.0)
            assert core.load.num_running == 0 and core.load.num_free_blocks == 64
        finally:
            await core.stop()
    assert results["process"] == results["thread"]
    assert all(len(tokens) == 12 for tokens in results["process"])
    # The probe ran after every step, in the engine's loop, and its results reached the loop.
    assert max(probed["process"]) == len(PROMPTS)
    assert len(probed["process"]) >= 12


async def test_the_kv_cache_is_shared_with_the_engine_process(tiny_checkpoint: Path) -> None:
    """A decode worker's transfers write the cache from the worker's side: the engine must read
    what was written."""
    core = await start_engine_core("process", config(tiny_checkpoint), OutputStreams().dispatch)
    try:
        cache = core.facts.kv_cache_tensors[0]
        assert cache.is_shared()
        flat = cache.view(-1)
        flat[1234] = 3.5
        assert await core.call(read_cache_value, 1234) == 3.5
        flat[1234] = -1.25
        assert await core.call(read_cache_value, 1234) == -1.25
    finally:
        await core.stop()


async def test_an_argument_that_does_not_pickle_fails_its_call_only(
    tiny_checkpoint: Path,
) -> None:
    core = await start_engine_core("process", config(tiny_checkpoint), OutputStreams().dispatch)
    try:
        with pytest.raises(Exception, match="pickle"):
            await core.call(read_cache_value, lambda: 0)  # type: ignore[arg-type]
        assert await core.call(read_cache_value, 0) == await core.call(read_cache_value, 0)
    finally:
        await core.stop()


async def test_a_dead_engine_process_fails_its_calls_and_tells_the_worker(
    tiny_checkpoint: Path,
) -> None:
    deaths: list[str] = []
    core = await start_engine_core(
        "process", config(tiny_checkpoint), OutputStreams().dispatch, on_death=deaths.append
    )
    assert isinstance(core, EngineProcess) and core.pid is not None
    try:
        waiting = asyncio.ensure_future(core.call(_sleep_in_engine, 30.0))
        await asyncio.sleep(0.5)
        os.kill(core.pid, signal.SIGKILL)
        with pytest.raises(EngineProcessDied):
            await asyncio.wait_for(waiting, 10.0)
        assert deaths and "exit code -9" in deaths[0]
        assert not core.alive
        with pytest.raises(EngineProcessDied):
            await core.call(read_cache_value, 0)
    finally:
        await core.stop()


def _sleep_in_engine(engine: LLMEngine, seconds: float) -> None:
    import time

    time.sleep(seconds)


async def test_a_model_that_does_not_load_is_an_error_not_a_hang(tmp_path: Path) -> None:
    with pytest.raises(EngineProcessDied, match="could not load"):
        await asyncio.wait_for(
            start_engine_core(
                "process", EngineConfig(model=str(tmp_path / "missing")), lambda _: None
            ),
            120.0,
        )


async def test_torch_share_memory_is_in_place() -> None:
    """What the engine process relies on: moving a tensor to shared memory keeps its views."""
    base = torch.zeros(4, 8)
    view = base[1]
    base.share_memory_()
    base[1, 3] = 7.0
    assert view[3] == 7.0 and base.is_shared()


async def test_auto_is_a_process_for_a_cpu_worker_with_two_cpus_and_one_rank() -> None:
    cpu = EngineConfig(model="demo", device="cpu")
    ranks = EngineConfig(model="demo", device="cpu", tensor_parallel_size=2)
    assert resolve_engine_core("auto", cpu, num_cpus=2) == "process"
    assert resolve_engine_core("auto", cpu, num_cpus=1) == "thread"
    assert resolve_engine_core("auto", ranks, num_cpus=8) == "thread"
    assert resolve_engine_core("thread", cpu, num_cpus=2) == "thread"
    assert resolve_engine_core("process", cpu, num_cpus=1) == "process"
