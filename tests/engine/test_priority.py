"""Priorities on a real (tiny) model: a batch request preempted for an interactive one, by
admission or by a decode worker's reservation, resumes with exactly the tokens it would have
produced alone; `LLM.generate` takes vLLM's per-prompt `priority`."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from nori.engine.engine import LLMEngine
from nori.engine.llm import LLM
from nori.engine.outputs import StepOutput
from nori.engine.request import KVFromRemote, KVToRemote, NoFreeBlocks
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.params import SamplingParams
from nori.settings import BATCH_PRIORITY

BLOCK_SIZE = 8
GREEDY_BATCH = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
GREEDY_INTERACTIVE = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
REMOTE = KVFromRemote()
_rng = random.Random(5)
BATCH_PROMPT = [_rng.randrange(3, 500) for _ in range(30)]
INTERACTIVE_PROMPT = [_rng.randrange(3, 500) for _ in range(24)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    init_checkpoint(folder, "tiny", seed=17)
    return folder


@pytest.fixture(scope="module")
def alone(checkpoint: Path) -> dict[str, list[int]]:
    """Each request's greedy tokens when it runs alone in a roomy pool: nothing preempted."""
    llm = LLM(str(checkpoint), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=64)
    batch = llm.generate(BATCH_PROMPT, GREEDY_BATCH, use_tqdm=False)
    interactive = llm.generate(INTERACTIVE_PROMPT, GREEDY_INTERACTIVE, use_tqdm=False)
    return {"batch": batch[0].outputs[0].token_ids, "i": interactive[0].outputs[0].token_ids}


def small_engine(checkpoint: Path) -> LLMEngine:
    """10 blocks of 8: the batch request (70 tokens at most) alone nearly fills it."""
    return LLM(str(checkpoint), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=10).engine


def run_batch_until_it_holds(engine: LLMEngine, num_blocks: int) -> None:
    engine.add_request("batch", BATCH_PROMPT, GREEDY_BATCH, priority=BATCH_PRIORITY)
    while engine.load().num_free_blocks > engine.load().num_total_blocks - num_blocks:
        assert all(not output.finished for output in engine.step())


def run_to_completion(engine: LLMEngine) -> dict[str, StepOutput]:
    """Every request's final output, in the order they finished."""
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.kv_cache.check_invariants()
    return finished


def test_an_interactive_request_preempts_a_batch_one_which_resumes_identically(
    checkpoint: Path, alone: dict[str, list[int]]
) -> None:
    engine = small_engine(checkpoint)
    run_batch_until_it_holds(engine, 8)
    # 3 blocks for the prompt, 2 free: the batch request gives its 8 back and waits.
    engine.add_request("i", INTERACTIVE_PROMPT, GREEDY_INTERACTIVE)
    engine.step()
    assert engine.load().num_preemptions == 1
    assert engine.load().running_request_ids == {"i"} and engine.load().num_waiting == 1
    finished = run_to_completion(engine)
    assert list(finished) == ["i", "batch"]
    assert finished["i"].token_ids == alone["i"]
    assert finished["batch"].token_ids == alone["batch"]
    # Recomputed from the blocks the interactive request left in the prefix cache: 6 of the
    # 7 full ones (it took the 8th, partial one, then the 7th as it grew).
    assert finished["batch"].num_cached_tokens == 6 * BLOCK_SIZE
    assert engine.load().num_preemptions == 1


def test_equal_priorities_wait_instead(checkpoint: Path, alone: dict[str, list[int]]) -> None:
    engine = small_engine(checkpoint)
    run_batch_until_it_holds(engine, 8)
    engine.add_request("i", INTERACTIVE_PROMPT, GREEDY_INTERACTIVE, priority=BATCH_PRIORITY)
    finished = run_to_completion(engine)
    assert list(finished) == ["batch", "i"] and engine.load().num_preemptions == 0
    assert finished["i"].token_ids == alone["i"]


def test_a_reservation_preempts_a_batch_request_on_a_decode_engine(
    checkpoint: Path, alone: dict[str, list[int]]
) -> None:
    """The cluster's path: the decode engine reserves blocks for an urgent prompt (preempting
    the batch request decoding there), the prefill engine computes it, its K/V lands."""
    decode = small_engine(checkpoint)
    run_batch_until_it_holds(decode, 8)
    urgent = 3
    with pytest.raises(NoFreeBlocks):
        decode.add_request(
            "i", INTERACTIVE_PROMPT, GREEDY_INTERACTIVE, priority=BATCH_PRIORITY, remote_kv=REMOTE
        )
    assert decode.load().num_preemptions == 0
    block_ids = decode.add_request(
        "i", INTERACTIVE_PROMPT, GREEDY_INTERACTIVE, priority=urgent, remote_kv=REMOTE
    )
    # The prompt and its first sampled token: 4 blocks, 3 of them for the prompt's K/V.
    assert block_ids is not None and len(block_ids) == 3
    assert decode.load().num_preemptions == 1 and decode.load().running_request_ids == set()
    decode.kv_cache.check_invariants()

    prefill = LLM(str(checkpoint), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=16)
    prefill.engine.add_request(
        "i", INTERACTIVE_PROMPT, GREEDY_INTERACTIVE, remote_kv=KVToRemote(), priority=urgent
    )
    while prefill.engine.has_unfinished_requests():
        prefill.engine.step()
    export = prefill.engine.export_request("i")
    prefill.engine.finish_kv_transfer("i")
    assert export.state.priority == urgent
    for cache, blocks in zip(decode.kv_cache.tensors, export.blocks, strict=True):
        for position, block_id in enumerate(block_ids):
            cache[:, :, block_id].copy_(blocks[:, :, position])
    decode.finish_kv_transfer("i", export.state.output_token_ids, export.state.generator_state)

    finished = run_to_completion(decode)
    assert list(finished) == ["i", "batch"]
    assert finished["i"].token_ids == alone["i"]
    assert finished["batch"].token_ids == alone["batch"]


def test_generate_takes_a_priority_per_prompt(checkpoint: Path, monkeypatch: Any) -> None:
    llm = LLM(str(checkpoint), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=32)
    seen: list[tuple[str, int]] = []
    add_request = llm.engine.add_request

    def recording(request_id: str, *args: Any, **kwargs: Any) -> None:
        seen.append((request_id, kwargs.get("priority", 0)))
        add_request(request_id, *args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", recording)
    params = SamplingParams(n=2, max_tokens=2, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(["a b", "c d"], params, use_tqdm=False, priority=[BATCH_PRIORITY, 0])
    assert [priority for _, priority in seen] == [BATCH_PRIORITY, BATCH_PRIORITY, 0, 0]
    assert len(outputs) == 2
    seen.clear()
    llm.generate("a b", GREEDY_INTERACTIVE, use_tqdm=False)
    assert [priority for _, priority in seen] == [0]
    with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
        llm.generate(["a", "b"], params, use_tqdm=False, priority=[0])
