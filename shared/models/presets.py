"""Named model shapes for `nori model init`: test sizes, a demo size, and real models' shapes.

The token ids below are fixed by `tokenizer_builder`, which puts its special tokens first."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

from nori.models.config import ModelConfig, RopeScaling
from nori.models.errors import ModelLoadError
from nori.models.tokenizer_builder import BOS_ID, EOS_IDS

_TINY = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_IDS,
    torch_dtype="float32",
)

_LLAMA3_1B = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_IDS,
    torch_dtype="bfloat16",
)

_DEMO = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    # Scaling on so the demo exercises the Llama 3.1 RoPE path end to end.
    rope_scaling=RopeScaling(8.0, 1.0, 4.0, 1024),
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_IDS,
    torch_dtype="float32",
)

# 24M parameters: a long prompt's prefill visibly stalls CPU decode steps.
_SMALL = replace(
    _DEMO,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
)

_QWEN3_06B = ModelConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    qk_norm=True,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_IDS,
    torch_dtype="bfloat16",
)

# `small-moe`: `small` with each MLP made 8 experts of half its width, 2 per token (the same
# parameters active per token, four times the MLP parameters in all).
_SMALL_MOE = replace(
    _SMALL,
    architecture="MixtralForCausalLM",
    rope_scaling=None,
    intermediate_size=_SMALL.intermediate_size // 2,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=_SMALL.intermediate_size // 2,
    norm_topk_prob=True,
)
_TINY_MOE = replace(_TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

PRESETS: Mapping[str, ModelConfig] = MappingProxyType(
    {
        "tiny": _TINY,
        "tiny-qwen2": replace(
            _TINY,
            architecture="Qwen2ForCausalLM",
            attention_bias=True,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
        ),
        "tiny-qwen3": replace(
            _TINY,
            architecture="Qwen3ForCausalLM",
            qk_norm=True,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
        ),
        "tiny-mixtral": replace(
            _TINY_MOE,
            architecture="MixtralForCausalLM",
            intermediate_size=32,
            norm_topk_prob=True,
        ),
        "tiny-qwen2-moe": replace(
            _TINY_MOE,
            architecture="Qwen2MoeForCausalLM",
            attention_bias=True,
            shared_expert_intermediate_size=96,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
        ),
        "tiny-qwen3-moe": replace(
            _TINY_MOE,
            architecture="Qwen3MoeForCausalLM",
            qk_norm=True,
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
        ),
        "demo": _DEMO,
        "small": _SMALL,
        "small-moe": _SMALL_MOE,
        "llama3-1b": _LLAMA3_1B,
        "llama3-8b": replace(
            _LLAMA3_1B,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            head_dim=128,
            rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
            tie_word_embeddings=False,
        ),
        "qwen3-0.6b": _QWEN3_06B,
    }
)


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelLoadError(
            f"unknown model preset {name!r}; available: {', '.join(PRESETS)}"
        ) from None
