"""The 8-bit KV cache (--kv-cache-dtype int8|fp8) in the engine.

The reference is independent of the paged path: the model run densely over one whole sequence,
its K/V rows quantized and dequantized by the PyTorch reference (what an 8-bit cache holds), fed
the engine's own greedy tokens. The engine reads every K/V row back from its cache (its own
prompt's too), so its logits must be that reference's at every step, whatever the step's shape:
batched, from prefix-cache hits, in chunks, after preemption, on each attention backend.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from nori.bench.fidelity import model_logits, stored_kv_attention
from nori.engine.config import EngineConfig
from nori.engine.kv_cache import KVCache, bytes_per_block
from nori.engine.llm import LLM
from nori.kernels.cpu_build import cpu_kernels
from nori.kernels.kv_quant import KV_CACHE_DTYPES
from nori.models.config import ModelConfig
from nori.models.init_checkpoint import init_checkpoint
from nori.models.loader import load_model
from nori.models.presets import PRESETS
from nori.sampling.params import SamplingParams
from tests.engine.reference import trace_engine

NEW_TOKENS = 16
LOGITS_ATOL = 1e-4
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    init_checkpoint(folder, "tiny", seed=1)
    return folder


def mixed_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (1, 7, 17, 31, 40, 5)]


def shared_prefix_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(1)
    prefix = [rng.randrange(3, vocab_size) for _ in range(29)]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(n)] for n in (1, 6, 13, 0)]


def assert_logits_are_over_the_stored_kv(
    llm: LLM, checkpoint: Path, kv_dtype: str, prompts: list[list[int]]
) -> list:
    with trace_engine(llm.engine) as trace:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    model, _ = load_model(checkpoint, torch.float32, "cpu")
    attention = stored_kv_attention(KV_CACHE_DTYPES[kv_dtype])
    for index, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        tokens = output.outputs[0].token_ids
        assert len(tokens) == NEW_TOKENS
        ids = torch.tensor(prompt + tokens[:-1])
        expected = model_logits(model, ids, attention)[len(prompt) - 1 :]
        got = trace.stacked(output.request_id)
        torch.testing.assert_close(
            got, expected, atol=LOGITS_ATOL, rtol=0, msg=lambda m, i=index: f"prompt {i}: {m}"
        )
        assert tokens == expected.argmax(dim=-1).tolist()
    llm.engine.kv_cache.check_invariants()
    assert llm.engine.load().num_free_blocks == llm.engine.load().num_total_blocks
    return [outputs, trace]


def backends() -> list[str]:
    """The references, and the engine's own kernels where the tests run: the C++ ones on CPU
    (the Triton ones have a test of their own below, in the interpreter there)."""
    if torch.cuda.is_available():
        return ["reference", "triton"]
    return ["reference", "cpu"] if cpu_kernels() is not None else ["reference"]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("backend", backends())
def test_batched_prefix_hits_and_chunks_read_the_stored_kv(
    checkpoint: Path, kv_dtype: str, backend: str
) -> None:
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        num_kv_blocks=256,
        block_size=4,
        max_num_batched_tokens=24,
        kv_cache_dtype=kv_dtype,
        attention_backend=backend,
    )
    vocab = llm.engine.model.config.vocab_size
    _, trace = assert_logits_are_over_the_stored_kv(llm, checkpoint, kv_dtype, mixed_prompts(vocab))
    assert trace.num_chunked_steps > 0
    shared = shared_prefix_prompts(vocab)
    assert_logits_are_over_the_stored_kv(llm, checkpoint, kv_dtype, shared)
    second, _ = assert_logits_are_over_the_stored_kv(llm, checkpoint, kv_dtype, shared)
    assert all(output.num_cached_tokens > 0 for output in second)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_preempted_requests_recompute_the_same_stored_kv(checkpoint: Path, kv_dtype: str) -> None:
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        block_size=4,
        num_kv_blocks=24,
        enable_prefix_caching=False,
        kv_cache_dtype=kv_dtype,
    )
    prompts = mixed_prompts(llm.engine.model.config.vocab_size)
    _, trace = assert_logits_are_over_the_stored_kv(llm, checkpoint, kv_dtype, prompts)
    assert trace.num_preemptions > 0


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_the_triton_kernels_read_the_stored_kv(checkpoint: Path, kv_dtype: str) -> None:
    """The GPU path (store, decode and prefill kernels), here in Triton's interpreter."""
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        num_kv_blocks=64,
        block_size=8,
        max_num_batched_tokens=24,
        kv_cache_dtype=kv_dtype,
        attention_backend="triton",
    )
    prompts = [mixed_prompts(llm.engine.model.config.vocab_size)[i] for i in (1, 3)]
    _, trace = assert_logits_are_over_the_stored_kv(llm, checkpoint, kv_dtype, prompts)
    assert trace.num_chunked_steps > 0


def test_the_pool_holds_about_twice_bf16s_tokens_and_four_times_float32s() -> None:
    """The 24M preset (head_dim 64): 64 code bytes and a 2-byte scale per token and kv head
    against 128 (bf16) and 256 (float32)."""
    model = PRESETS["small"]
    per_block = {
        dtype: bytes_per_block(model, 16, dtype)
        for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn)
    }
    assert per_block[torch.int8] == per_block[torch.float8_e4m3fn]
    assert (
        per_block[torch.int8]
        == 2 * model.num_hidden_layers * model.num_key_value_heads * (model.head_dim + 2) * 16
    )
    assert per_block[torch.bfloat16] / per_block[torch.int8] >= 1.9
    assert per_block[torch.float32] / per_block[torch.int8] >= 3.8


def test_a_memory_budget_buys_the_8_bit_cache_more_blocks(checkpoint: Path) -> None:
    # --cpu-kv-cache-gib sizes the pool of a CPU engine only: pinned to the CPU on a GPU host too.
    budget = dict(device="cpu", cpu_kv_cache_gib=2**-10, max_num_seqs=256, max_model_len=64)
    float_blocks = LLM(str(checkpoint), **budget).engine.load().num_total_blocks
    int8 = LLM(str(checkpoint), kv_cache_dtype="int8", **budget)
    model = int8.engine.model.config
    expected = 2**20 // bytes_per_block(model, int8.engine.config.block_size, torch.int8)
    assert int8.engine.load().num_total_blocks == expected
    assert int8.engine.load().num_total_blocks >= 3 * float_blocks


def test_blocks_move_between_caches_as_stored_and_float_and_8_bit_do_not_mix(
    checkpoint: Path,
) -> None:
    model = ModelConfig.from_dir(checkpoint)
    cpu = torch.device("cpu")
    source = KVCache.allocate(model, 8, 4, torch.float8_e4m3fn, cpu)
    assert source.scales is not None and len(source.tensors) == 2
    source.data.view(torch.uint8).copy_(torch.randint(0, 0x7F, source.data.shape))
    source.scales.copy_(torch.rand(source.scales.shape) + 0.5)
    destination = KVCache.allocate(model, 8, 4, torch.float8_e4m3fn, cpu)
    blocks = source.read_blocks([5, 2])
    destination.write_blocks([1, 6], blocks)
    for tensor, original in zip(destination.tensors, source.tensors, strict=True):
        assert torch.equal(
            tensor[:, :, [1, 6]].view(torch.uint8), original[:, :, [5, 2]].view(torch.uint8)
        )
    with pytest.raises(ValueError, match="float and 8-bit caches do not mix"):
        KVCache.allocate(model, 8, 4, torch.float32, cpu).write_blocks([0, 1], blocks)
    int8 = KVCache.allocate(model, 8, 4, torch.int8, cpu)
    with pytest.raises(ValueError, match=r"the cache holds torch\.int8"):
        int8.write_blocks([0, 1], blocks)


def test_unknown_kv_cache_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        EngineConfig(kv_cache_dtype="int4")
