"""Tensor parallelism on CPU (gloo, ranks as processes): TP=2 is TP=1, to the token and to 1e-4
in every sampled step's logits, on the tiny Llama, Qwen2 and Qwen3 checkpoints and stories260K;
KV blocks leave a TP=2 engine and enter one with every head, so a request moves between engines
of different sizes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from nori.engine.llm import LLM
from nori.engine.request import KVExport, KVToRemote
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.params import SamplingParams
from tests.engine.reference import trace_engine
from tests.models.model_helpers import STORIES_260K

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
LOGITS_ATOL = 1e-4
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
ENGINE = {"num_kv_blocks": 128, "block_size": 8, "max_num_batched_tokens": 48}


def prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab_size) for _ in range(20)]
    # Mixed lengths (one chunked), and a shared prefix that later prompts hit in the cache.
    fresh = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (1, 9, 60)]
    return [*fresh, [*prefix, 5, 6, 7], [*prefix, 8]]


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen2", "tiny-qwen3", "stories260K"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "stories260K":
        if not (STORIES_260K / "config.json").exists():
            pytest.skip(f"stories260K not found at {STORIES_260K}")
        return STORIES_260K
    folder = tmp_path_factory.mktemp(request.param)
    init_checkpoint(folder, request.param, seed=1)
    return folder


def generate_traced(llm: LLM, batch: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    with trace_engine(llm.engine) as trace:
        outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    return (
        [output.outputs[0].token_ids for output in outputs],
        [trace.stacked(output.request_id) for output in outputs],
    )


def test_two_ranks_match_one(checkpoint: Path) -> None:
    single = LLM(str(checkpoint), **ENGINE)
    batch = prompts(single.engine.model.config.vocab_size)
    want_tokens, want_logits = generate_traced(single, batch)
    with LLM(str(checkpoint), tensor_parallel_size=2, **ENGINE) as split:
        got_tokens, got_logits = generate_traced(split, batch)
        # Again: the shared prefix now comes from the prefix cache, on both ranks.
        again_tokens, _ = generate_traced(split, batch)
        split.engine.kv_cache.check_invariants()
    assert got_tokens == want_tokens
    assert again_tokens == want_tokens
    for index, (got, want) in enumerate(zip(got_logits, want_logits, strict=True)):
        torch.testing.assert_close(
            got, want, atol=LOGITS_ATOL, rtol=0, msg=lambda m, i=index: f"prompt {i}: {m}"
        )


def test_two_ranks_with_an_8_bit_kv_cache_match_one(tmp_path: Path) -> None:
    """Each rank quantizes its own heads; per-head scales make that the TP=1 cache, split."""
    init_checkpoint(tmp_path, "tiny", seed=2)
    single = LLM(str(tmp_path), kv_cache_dtype="int8", **ENGINE)
    batch = prompts(single.engine.model.config.vocab_size)
    want_tokens, want_logits = generate_traced(single, batch)
    with LLM(str(tmp_path), tensor_parallel_size=2, kv_cache_dtype="int8", **ENGINE) as split:
        got_tokens, got_logits = generate_traced(split, batch)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=0)


def test_a_request_moves_between_engines_of_different_tensor_parallel_sizes(
    tmp_path: Path,
) -> None:
    """Prefill on 2 ranks, decode on 1; then prefill on 1, decode on 2: each export holds every
    kv head (gathered from the ranks), each import gives each rank its heads."""
    init_checkpoint(tmp_path, "tiny-qwen3", seed=3)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    single = LLM(str(tmp_path), **ENGINE)
    batch = prompts(single.engine.model.config.vocab_size)
    expected = [o.outputs[0].token_ids for o in single.generate(batch, params, use_tqdm=False)]

    def prefill(engine: LLM, index: int, prompt: list[int]) -> KVExport:
        request_id = f"req-{index}"
        engine.engine.add_request(request_id, prompt, params, remote_kv=KVToRemote())
        while engine.engine.has_unfinished_requests():
            engine.engine.step()
        export = engine.engine.export_request(request_id)
        engine.engine.finish_kv_transfer(request_id)
        return export

    def decode(engine: LLM, exports: list[KVExport]) -> list[list[int]]:
        for export in exports:
            assert engine.engine.import_request(export)
        finished: dict[str, list[int]] = {}
        while engine.engine.has_unfinished_requests():
            for output in engine.engine.step():
                if output.finished:
                    finished[output.request_id] = output.token_ids
        return [finished[e.state.request_id] for e in exports]

    with LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE) as split:
        exports = [prefill(split, i, p) for i, p in enumerate(batch)]
    assert decode(LLM(str(tmp_path), **ENGINE), exports) == expected

    exports = [prefill(LLM(str(tmp_path), **ENGINE), i, p) for i, p in enumerate(batch)]
    with LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE) as split:
        assert decode(split, exports) == expected
        split.engine.kv_cache.check_invariants()


def test_sizes_that_do_not_divide_the_model_are_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    init_checkpoint(tmp_path, "tiny", seed=1)  # 4 query heads, 2 kv heads
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 must divide the model's"):
        LLM(str(tmp_path), tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(str(tmp_path), tensor_parallel_size=0)
