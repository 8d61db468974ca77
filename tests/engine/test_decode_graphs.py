"""Decode CUDA graphs: the bucket sizes, and on CPU the path a graph records (padded rows over
the persistent step-input buffers, the Triton kernels under the interpreter, splits sized by
max_model_len) against the eager step, token for token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nori.engine.config import EngineConfig
from nori.engine.decode_graphs import DecodeGraphs, capture_sizes
from nori.engine.engine import LLMEngine
from nori.engine.model_runner import ModelRunner
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.params import SamplingParams


def test_capture_sizes_are_vllms_buckets_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    sizes = capture_sizes(256)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-2:] == (248, 256) and len(sizes) == 35


def test_a_batch_pads_to_the_smallest_captured_size_that_holds_it() -> None:
    graphs = DecodeGraphs(capture_sizes(20))
    assert [graphs.padded_size(b) for b in (1, 2, 3, 5, 8, 9, 17, 20)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        20,
        20,
    ]
    assert graphs.padded_size(21) is None


class _RecordedForward(DecodeGraphs):
    """Replays by running the forward a graph would record, on the same buffers (no CUDA)."""

    def capture(self, forward: Callable[[int], torch.Tensor], device: torch.device) -> None:
        self._forward = forward
        self.replayed: list[int] = []

    def replay(self, size: int) -> torch.Tensor:
        self.replayed.append(size)
        return self._forward(size)


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    tokens: dict[str, list[int]] = {}
    for index, prompt in enumerate(prompts):
        params = (
            SamplingParams(max_tokens=10, temperature=0.8, seed=index, ignore_eos=True)
            if index % 2
            else SamplingParams(max_tokens=6 + index, temperature=0.0, ignore_eos=True)
        )
        engine.add_request(f"r{index}", prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return [tokens[f"r{index}"] for index in range(len(prompts))]


def test_padded_decode_over_the_step_buffers_gives_the_eager_tokens(tmp_path: Path) -> None:
    model = init_checkpoint(tmp_path / "tiny", "tiny")
    config = EngineConfig(
        model=str(model),
        num_kv_blocks=64,
        dtype="float32",
        attention_backend="triton",
        max_num_seqs=6,
    )
    prompts = [[5 + i, 9, 33, 2, 7 * i + 1][: 3 + i % 3] for i in range(5)]
    eager_config = replace(config, enforce_eager=True)
    eager = _generate(LLMEngine(eager_config, runner=ModelRunner(eager_config, model)), prompts)

    runner = ModelRunner(config, model)
    graphs = _RecordedForward(capture_sizes(config.max_num_seqs))
    runner.capture_graphs(graphs)
    # The capture leaves padding in the buffers: no slot is written by a padded row.
    slots = runner._inputs.decode_batch(6, 8)[2].slot_mapping
    assert slots.tolist() == [-1] * 6
    graphed = _generate(LLMEngine(config, runner=runner), prompts)
    assert graphed == eager
    # Greedy requests finish after 6, 8 and 10 tokens, seeded ones after 10: batches of 5, 4
    # and 3, padded to 6, 4 and 4.
    assert set(graphs.replayed) == {6, 4}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_give_the_eager_tokens(tmp_path: Path) -> None:
    model = init_checkpoint(tmp_path / "tiny", "tiny")
    config = EngineConfig(model=str(model), num_kv_blocks=64, max_num_seqs=6, dtype="bfloat16")
    prompts = [[5 + i, 9, 33, 2, 7 * i + 1][: 3 + i % 3] for i in range(5)]
    eager_config = replace(config, enforce_eager=True)
    eager_runner = ModelRunner(eager_config, model)
    assert eager_runner.graphs is None
    eager = _generate(LLMEngine(eager_config, runner=eager_runner), prompts)
    runner = ModelRunner(config, model)
    assert runner.graphs is not None and runner.graphs.sizes == (1, 2, 4, 6)
    assert _generate(LLMEngine(config, runner=runner), prompts) == eager
