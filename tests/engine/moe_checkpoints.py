"""Tiny mixture-of-experts checkpoints written by transformers itself (its own config classes,
random weights, `save_pretrained`), one per architecture Nori serves, plus Nori's tokenizer files.

Shapes are small but keep every routing path busy: 8 experts, 2 per token (so some experts get
no token in a step and others many), Qwen2-MoE with its shared expert, a dense layer
(`mlp_only_layers`) and no top-k renormalisation, Qwen3-MoE with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from nori.models.tokenizer_builder import BOS_ID, EOS_IDS, build_tokenizer_json, tokenizer_config

MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
VOCAB_SIZE = 512

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "num_experts_per_tok": 2,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_IDS[0],
    "tie_word_embeddings": False,
}


def transformers_config(architecture: str, **overrides: Any) -> Any:
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if architecture == "mixtral":
        values = {
            **_COMMON,
            "num_hidden_layers": 2,
            "num_local_experts": 8,
            "intermediate_size": 48,
            "rope_theta": 10000.0,
        }
        return MixtralConfig(**{**values, **overrides})
    if architecture == "qwen2_moe":
        values = {
            **_COMMON,
            "num_hidden_layers": 3,
            "num_experts": 8,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 80,
            "intermediate_size": 96,
            "mlp_only_layers": [1],
            "norm_topk_prob": False,
        }
        return Qwen2MoeConfig(**{**values, **overrides})
    if architecture == "qwen3_moe":
        values = {
            **_COMMON,
            "num_hidden_layers": 2,
            "num_experts": 8,
            "moe_intermediate_size": 40,
            "intermediate_size": 96,
            "norm_topk_prob": True,
        }
        return Qwen3MoeConfig(**{**values, **overrides})
    raise ValueError(architecture)


def write_moe_checkpoint(folder: Path, architecture: str, seed: int = 1, **overrides: Any) -> Path:
    """transformers' randomly initialised model of this architecture, saved into `folder`.

    The initializer's std of 0.02 leaves tiny routing logits (every expert near 1/8); the
    router weights are scaled up so that routing is decisive and differs between tokens.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(transformers_config(architecture, **overrides))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                parameter.mul_(10.0)
            elif not name.endswith("norm.weight"):
                parameter.mul_(3.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(build_tokenizer_json(VOCAB_SIZE), "utf-8")
    config = tokenizer_config(_COMMON["max_position_embeddings"])
    (folder / "tokenizer_config.json").write_text(json.dumps(config), "utf-8")
    return folder
