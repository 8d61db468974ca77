"""Prefill on one engine, export the KV blocks, import into another, decode there.

The result must be token-identical to one engine doing both: the operation prefill and decode
workers are built on.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from nori.engine.engine import LLMEngine
from nori.engine.llm import LLM
from nori.engine.outputs import StepOutput
from nori.engine.request import KVFromRemote, KVToRemote
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.params import SamplingParams

PARAMS = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.7, top_k=20, seed=7, repetition_penalty=1.2),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    init_checkpoint(folder, "tiny", seed=3)
    return folder


def run_to_completion(engine: LLMEngine) -> dict[str, StepOutput]:
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def prefill(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[str]:
    ids = [f"req-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params, remote_kv=KVToRemote())
    prefilled = set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.prefilled and not output.finished
            assert len(output.token_ids) == 1
            prefilled.add(output.request_id)
    assert prefilled == set(ids)
    return ids


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded-top-p", "seeded-penalty"])
def test_prefill_export_import_decode_is_token_identical(
    checkpoint: Path, params: SamplingParams
) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (2, 9, 16, 33, 50)]
    reference_llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=256, block_size=8)
    expected = [output.outputs[0] for output in reference_llm.generate(prompts, params)]

    prefill_engine = LLM(str(checkpoint), dtype="float32", block_size=8, num_kv_blocks=64).engine
    decode_engine = LLM(str(checkpoint), dtype="float32", block_size=8, num_kv_blocks=96).engine
    # Occupy the decode engine's first blocks so imported requests land on other block ids.
    decode_engine.add_request("resident", [1, 2, 3] * 11, SamplingParams(max_tokens=1))
    decode_engine.step()
    free_before = prefill_engine.load().num_free_blocks

    ids = prefill(prefill_engine, prompts, params)
    for request_id in ids:
        export = prefill_engine.export_request(request_id)
        prefill_engine.finish_kv_transfer(request_id)
        assert decode_engine.import_request(export)
        assert request_id in decode_engine.load().running_request_ids
        # "resident" holds the first blocks, and no block is held twice: other block ids.
        decode_engine.kv_cache.check_invariants()
    assert prefill_engine.load().num_free_blocks == free_before
    prefill_engine.kv_cache.check_invariants()

    finished = run_to_completion(decode_engine)
    for request_id, reference in zip(ids, expected, strict=True):
        assert finished[request_id].token_ids == reference.token_ids
        assert finished[request_id].text == reference.text
    decode_engine.kv_cache.check_invariants()


def test_reserved_blocks_are_freed_by_abort(checkpoint: Path) -> None:
    prefill_engine = LLM(str(checkpoint), dtype="float32", num_kv_blocks=256, block_size=8).engine
    decode_engine = LLM(str(checkpoint), dtype="float32", block_size=8, num_kv_blocks=32).engine
    prefill(prefill_engine, [[5] * 20], PARAMS[0])
    export = prefill_engine.export_request("req-0")
    free_before = decode_engine.load().num_free_blocks
    state = export.state
    block_ids = decode_engine.add_request(
        state.request_id, state.prompt_token_ids, state.sampling_params, remote_kv=KVFromRemote()
    )
    assert block_ids is not None and len(block_ids) == 3
    assert decode_engine.load().num_free_blocks == free_before - 3
    # The lease expires (or the sender dies): abort gives every reserved block back.
    decode_engine.abort_request("req-0")
    assert decode_engine.load().num_free_blocks == free_before
    decode_engine.kv_cache.check_invariants()


def test_reserve_reports_a_full_pool_and_bad_exports(checkpoint: Path) -> None:
    prefill_engine = LLM(str(checkpoint), dtype="float32", num_kv_blocks=256, block_size=8).engine
    prefill(prefill_engine, [[5] * 40], PARAMS[0])
    export = prefill_engine.export_request("req-0")
    small = LLM(str(checkpoint), dtype="float32", block_size=8, num_kv_blocks=8).engine
    small.add_request("resident", [7] * 39, SamplingParams(max_tokens=8))
    small.step()  # holds 5 of the 8 blocks; the import needs 6
    assert not small.import_request(export)
    # Nothing of it stays behind: its id is free again.
    small.add_request("req-0", [1], SamplingParams(max_tokens=1))
    small.abort_request("req-0")
    small.kv_cache.check_invariants()
    other_block_size = LLM(
        str(checkpoint), dtype="float32", num_kv_blocks=256, block_size=16
    ).engine
    with pytest.raises(ValueError, match="block size"):
        other_block_size.import_request(export)
    with pytest.raises(ValueError, match="not a prefilled request"):
        prefill_engine.export_request("nope")


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded-top-p", "seeded-penalty"])
def test_reserve_before_prefill_then_complete_is_token_identical(
    checkpoint: Path, params: SamplingParams
) -> None:
    """The cluster's order: the decode side reserves first, the K/V lands in those blocks."""
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 8, 17, 40)]
    reference_llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=256, block_size=8)
    expected = [output.outputs[0] for output in reference_llm.generate(prompts, params)]
    prefill_engine = LLM(str(checkpoint), dtype="float32", block_size=8, num_kv_blocks=64).engine
    decode_engine = LLM(str(checkpoint), dtype="float32", block_size=8, num_kv_blocks=96).engine
    free_before = decode_engine.load().num_free_blocks
    reserved = {}
    for index, prompt in enumerate(prompts):
        block_ids = decode_engine.add_request(
            f"req-{index}", prompt, params, remote_kv=KVFromRemote()
        )
        assert block_ids is not None and len(block_ids) == -(-len(prompt) // 8)
        reserved[f"req-{index}"] = block_ids
    # Room for the first sampled token is part of the reservation.
    assert free_before - decode_engine.load().num_free_blocks == sum(
        -(-(len(p) + 1) // 8) for p in prompts
    )

    ids = prefill(prefill_engine, prompts, params)
    first_tokens = {}
    for request_id in ids:
        export = prefill_engine.export_request(request_id)
        prefill_engine.finish_kv_transfer(request_id)
        # What a transport does: write each block straight into the reserved cache blocks.
        for cache, blocks in zip(decode_engine.kv_cache.tensors, export.blocks, strict=True):
            for position, block_id in enumerate(reserved[request_id]):
                cache[:, :, block_id].copy_(blocks[:, :, position])
        first_tokens[request_id] = export.state.output_token_ids
        decode_engine.finish_kv_transfer(
            request_id, export.state.output_token_ids, export.state.generator_state
        )

    finished = run_to_completion(decode_engine)
    for request_id, reference in zip(ids, expected, strict=True):
        got = finished[request_id]
        assert got.token_ids == reference.token_ids
        assert got.text == reference.text
        # The first token was reported by the prefill side; decode reports the rest.
        assert got.token_ids[:1] == first_tokens[request_id]
    assert decode_engine.load().num_free_blocks == free_before
    decode_engine.kv_cache.check_invariants()
    with pytest.raises(ValueError, match="no reserved blocks"):
        decode_engine.finish_kv_transfer("req-0", [1], None)
