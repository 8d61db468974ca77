"""The largest step the scheduler can send, built by hand before the KV cache exists: the step
that `nori.engine.memory_profile.profile_memory` runs to measure the peak activations."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nori.engine.attention_metadata import AttentionMetadata
from nori.engine.config import EngineConfig
from nori.engine.kv_cache import KVCache
from nori.engine.memory_profile import MemoryProfile, decode_graph_pool_bytes, profile_memory
from nori.engine.paged_attention import PagedAttention
from nori.models.config import ModelConfig
from nori.models.llama import CausalLM
from nori.sampling.batch import RowState, SamplingBatch, make_generator
from nori.sampling.params import SamplingParams
from nori.sampling.sampler import Sampler

# Every sampler stage on (penalties, top-k, top-p, min-p, logprobs): its largest temporaries.
_SAMPLING = SamplingParams(
    temperature=0.8,
    top_p=0.9,
    top_k=50,
    min_p=0.01,
    repetition_penalty=1.1,
    presence_penalty=0.1,
    frequency_penalty=0.1,
    logprobs=5,
)


@dataclass(frozen=True)
class DummyStep:
    """Sequences of `seq_lens` tokens of context, each its last `seq_len` new tokens (a prompt
    from position 0) or, with `decode`, its last one only (the decode kernels); the step's last
    `num_logits_rows` rows are sampled. Every table cycles over the same `num_blocks` scratch
    blocks (one for a decode), whose contents are garbage: only the shapes matter."""

    seq_lens: tuple[int, ...]
    num_logits_rows: int
    decode: bool = False

    @property
    def query_lens(self) -> tuple[int, ...]:
        return (1,) * len(self.seq_lens) if self.decode else self.seq_lens

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def num_blocks(self, block_size: int) -> int:
        return 1 if self.decode else self.table_width(block_size)

    def table_width(self, block_size: int) -> int:
        return -(-max(self.seq_lens) // block_size)


def dummy_step_shape(
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    num_speculative_tokens: int = 0,
) -> DummyStep:
    """The largest step: max_num_batched_tokens prompt tokens (no more than max_num_seqs
    prompts of max_model_len hold) in prompts of at most max_model_len tokens, and a logits row
    per sequence a step may sample (1 + num_speculative_tokens each), at most one per token."""
    tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    full, rest = divmod(tokens, max_model_len)
    seq_lens = (max_model_len,) * full + ((rest,) if rest else ())
    rows = min(max_num_seqs * (1 + num_speculative_tokens), tokens)
    return DummyStep(seq_lens, rows)


def dummy_decode_shape(batch_size: int, max_model_len: int) -> DummyStep:
    """A decode-only forward of `batch_size` rows at max_model_len context, no logits: what a
    decode CUDA graph of that size captures."""
    return DummyStep((max_model_len,) * batch_size, 0, decode=True)


def run_dummy_step(
    model: CausalLM,
    step: DummyStep,
    kv_cache: KVCache,
    attention_backend: str,
    sampler: Sampler,
) -> None:
    """One forward of `step` over `kv_cache` (at least `step.num_blocks` blocks), then a token
    sampled for each logits row with every sampler stage on. Under tensor parallelism every
    rank runs it at the same point (the forward's collectives)."""
    device, block_size = kv_cache.data.device, kv_cache.block_size
    num_blocks = step.num_blocks(block_size)
    table = torch.arange(step.table_width(block_size)) % num_blocks
    positions = torch.cat(
        [torch.arange(n - q, n) for n, q in zip(step.seq_lens, step.query_lens, strict=True)]
    )
    metadata = AttentionMetadata(
        slot_mapping=(table[positions // block_size] * block_size + positions % block_size).to(
            device
        ),
        num_decodes=len(step.seq_lens) if step.decode else 0,
        seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, *step.query_lens]).cumsum(0).to(torch.int32).to(device),
        block_tables=table.to(torch.int32).repeat(len(step.seq_lens), 1).to(device),
        max_seq_len=max(step.seq_lens),
    )
    input_ids = torch.zeros(step.num_tokens, dtype=torch.long, device=device)
    attention = PagedAttention(kv_cache, metadata, attention_backend)
    hidden = model(input_ids, positions.to(device), attention)
    if not step.num_logits_rows:
        return
    rows = torch.arange(step.num_tokens - step.num_logits_rows, step.num_tokens, device=device)
    logits = model.compute_logits(hidden[rows])
    del hidden
    state = RowState(params=_SAMPLING, prompt_token_ids=(0,), output_token_ids=(0,))
    sampler(logits, SamplingBatch.build([state] * step.num_logits_rows, device))


def profile_memory_budget(
    model: CausalLM,
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    attention_backend: str,
    graph_sizes: tuple[int, ...],
) -> MemoryProfile:
    """vLLM's profile run, on CUDA after loading: the largest step (`dummy_step_shape`) over a
    scratch cache, and with `graph_sizes` to capture the largest decode's activations (the graph
    pool's estimate). `model_config`: this rank's shard; `dtype`: the activations'."""
    device = next(model.parameters()).device
    weights = torch.cuda.memory_allocated(device)
    positions = model_config.max_position_embeddings
    max_len = min(config.max_model_len or positions, positions)
    sampler = Sampler(make_generator(config.seed, device))

    def peak(step: DummyStep, graph_pool: int = 0) -> MemoryProfile:
        blocks = step.num_blocks(config.block_size)
        scratch = KVCache.allocate(model_config, blocks, config.block_size, kv_dtype, device)
        run = lambda: run_dummy_step(model, step, scratch, attention_backend, sampler)  # noqa: E731
        return profile_memory(run, device, weights, graph_pool)

    graph_pool = 0
    if graph_sizes:
        decode_peak = peak(dummy_decode_shape(graph_sizes[-1], max_len)).peak_activations
        row_bytes = model_config.hidden_size * torch.empty((), dtype=dtype).element_size()
        graph_pool = decode_graph_pool_bytes(decode_peak, graph_sizes, row_bytes)
    spec = config.speculative_config
    step = dummy_step_shape(
        config.max_num_batched_tokens,
        config.max_num_seqs,
        max_len,
        0 if spec is None else spec.num_speculative_tokens,
    )
    profile = peak(step, graph_pool)
    torch.cuda.empty_cache()  # the scratch cache and activations go back before the pool
    return profile
