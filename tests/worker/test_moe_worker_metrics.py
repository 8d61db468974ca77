"""A worker's /metrics for a mixture-of-experts model: tokens per expert and layer, read from a
real engine core (thread and process) when scraped, and max/mean over the window; nothing for
a dense model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.engine.outputs import ExpertRoutingCounts, StepOutput, expert_imbalance
from nori.sampling.params import SamplingParams
from nori.worker.engine_core import EngineCore, EngineCoreMode, start_engine_core
from nori.worker.servicer_base import OutputStreams, next_output
from nori.worker.worker_metrics import EngineExpertCounts, WorkerMetrics
from tests.engine.moe_checkpoints import write_moe_checkpoint

pytestmark = pytest.mark.asyncio

# Qwen2-MoE: layers 0 and 2 routed (1 is dense), 8 experts, 2 per token.
ROUTED_LAYERS = ("0", "2")
NUM_EXPERTS, TOP_K = 8, 2
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_moe_checkpoint(tmp_path_factory.mktemp("moe-metrics"), "qwen2_moe")


async def generate(core: EngineCore, streams: OutputStreams, prompts: list[list[int]]) -> int:
    """Runs the prompts to the end; the positions the engine forwarded (no cache hits)."""

    async def one(index: int, prompt: list[int]) -> int:
        request_id = f"r{index}-{len(prompt)}"
        queue = streams.open(request_id)
        await core.call(LLMEngine.add_request, request_id, prompt, PARAMS)
        output: StepOutput = await next_output(queue)
        while not output.finished:
            output = await next_output(queue)
        streams.close(request_id)
        return len(prompt) + len(output.token_ids) - 1

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def scrape(
    text: str,
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """(layer -> tokens per expert, layer -> imbalance) from a /metrics text."""
    tokens: dict[str, list[float]] = {}
    imbalance: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "nori_moe_expert_tokens_total":
                layer = tokens.setdefault(sample.labels["layer"], [0.0] * NUM_EXPERTS)
                layer[int(sample.labels["expert"])] = sample.value
            elif sample.name == "nori_moe_expert_imbalance":
                imbalance[sample.labels["layer"]] = sample.value
    return tokens, imbalance


def as_lists(counts: ExpertRoutingCounts) -> dict[str, list[float]]:
    return {str(layer): [float(v) for v in values] for layer, values in counts.layers}


@pytest.mark.parametrize("mode", ["thread", "process"])
async def test_worker_metrics_show_the_engines_expert_load(
    qwen2_moe: Path, mode: EngineCoreMode
) -> None:
    config = EngineConfig(
        model=str(qwen2_moe),
        dtype="float32",
        block_size=8,
        num_kv_blocks=64,
        enable_prefix_caching=False,
    )
    streams = OutputStreams()
    core = await start_engine_core(mode, config, streams.dispatch)
    metrics = WorkerMetrics()
    # Window 0: each scrape's imbalance covers the tokens routed since the previous scrape.
    metrics.watch_experts(EngineExpertCounts(core, asyncio.get_running_loop()), window_s=0.0)
    server, port = metrics.serve("127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        first = await generate(core, streams, [[5, 9, 40, 41, 42, 300], [7, 8, 9, 10]])
        text = (await asyncio.to_thread(httpx.get, url)).text
        tokens, imbalance = scrape(text)
        engine_counts = await core.call(LLMEngine.expert_routing_counts)
        assert engine_counts is not None
        assert tokens == as_lists(engine_counts)
        assert sorted(tokens) == list(ROUTED_LAYERS)
        for layer in ROUTED_LAYERS:
            assert sum(tokens[layer]) == first * TOP_K
            # The first scrape's window: everything since the engine loaded.
            assert imbalance[layer] == pytest.approx(
                expert_imbalance(tuple(int(v) for v in tokens[layer]))
            )
            assert 1.0 <= imbalance[layer] <= NUM_EXPERTS

        second = await generate(core, streams, [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]])
        later_tokens, later_imbalance = scrape((await asyncio.to_thread(httpx.get, url)).text)
        for layer in ROUTED_LAYERS:
            window = [
                now - before for now, before in zip(later_tokens[layer], tokens[layer], strict=True)
            ]
            assert sum(window) == second * TOP_K
            assert later_imbalance[layer] == pytest.approx(
                expert_imbalance(tuple(int(v) for v in window))
            )
        # On the event loop's own thread (the worker's load line, a test) a collection never
        # waits for the engine: it shows the counts of the last scrape.
        on_loop, _ = scrape(generate_latest(metrics.registry).decode())
        assert on_loop == later_tokens
    finally:
        server.shutdown()
        await core.stop()


async def test_a_dense_model_has_no_expert_metrics() -> None:
    metrics = WorkerMetrics()
    asked = []

    def dense() -> None:
        asked.append(1)

    metrics.watch_experts(dense)
    text = generate_latest(metrics.registry).decode()
    assert asked and "nori_moe_" not in text
