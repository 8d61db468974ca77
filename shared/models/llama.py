"""One decoder for Llama 2/3, Mistral, Qwen2 and Qwen3; config flags select the differences.

Tokens of all sequences in a batch are flattened into one axis T. Everything here is per token
except the `attention` callable, which alone knows which tokens belong together.

q/k/v and gate/up projections are fused into one matmul each (fewer kernel launches per decode
step); `hf_weight_targets` maps Hugging Face's separate tensors onto row slices of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nori.models.attention import Attention
from nori.models.config import ModelConfig
from nori.models.rmsnorm import RMSNorm
from nori.models.rope import RotaryEmbedding, apply_rotary


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: rows [start, stop) of `parameter` (all rows if None)."""

    parameter: torch.Tensor
    start: int | None = None
    stop: int | None = None

    def view(self) -> torch.Tensor:
        if self.start is None:
            return self.parameter.data
        return self.parameter.data[self.start : self.stop]


@dataclass(frozen=True)
class _Factory:
    dtype: torch.dtype | None
    device: torch.device | str | None

    def linear(self, inputs: int, outputs: int, bias: bool) -> nn.Linear:
        return nn.Linear(inputs, outputs, bias=bias, dtype=self.dtype, device=self.device)

    def norm(self, size: int, eps: float) -> RMSNorm:
        return RMSNorm(size, eps, dtype=self.dtype, device=self.device)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, make: _Factory) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = make.linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias
        )
        self.o_proj = make.linear(self.q_size, config.hidden_size, config.attention_output_bias)
        self.q_norm = make.norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = make.norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attention(self.layer_index, q, k, v.contiguous(), self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig, make: _Factory) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = make.linear(
            config.hidden_size, 2 * config.intermediate_size, config.mlp_bias
        )
        self.down_proj = make.linear(config.intermediate_size, config.hidden_size, config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, make: _Factory) -> None:
        super().__init__()
        self.input_layernorm = make.norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_index, make)
        self.post_attention_layernorm = make.norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config, make)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Named `model` inside `CausalLM` so parameter names follow Hugging Face's."""

    def __init__(self, config: ModelConfig, make: _Factory) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, dtype=make.dtype, device=make.device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, index, make) for index in range(config.num_hidden_layers)
        )
        self.norm = make.norm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        make = _Factory(dtype, device)
        self.model = DecoderStack(config, make)
        self.rotary = RotaryEmbedding(config, device)
        # Tied models read the embedding matrix directly: a second Parameter sharing storage
        # would come apart when the module is built on "meta" and materialized with to_empty.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else make.linear(config.hidden_size, config.vocab_size, False)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]; call on the rows you sample from."""
        weight = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        return F.linear(hidden, weight).float()

    def reset_buffers(self) -> None:
        """Refills derived buffers after `to_empty` (which leaves them uninitialized)."""
        self.rotary.reset_buffers()

    def hf_weight_targets(self) -> dict[str, WeightTarget]:
        """Hugging Face checkpoint tensor name -> where its values go in this module."""
        config = self.config
        targets: dict[str, WeightTarget] = {
            "model.embed_tokens.weight": WeightTarget(self.model.embed_tokens.weight),
            "model.norm.weight": WeightTarget(self.model.norm.weight),
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = WeightTarget(self.lm_head.weight)
        q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
        for index, layer in enumerate(self.model.layers):
            assert isinstance(layer, DecoderLayer)
            prefix = f"model.layers.{index}"
            attn, mlp = layer.self_attn, layer.mlp
            targets[f"{prefix}.input_layernorm.weight"] = WeightTarget(layer.input_layernorm.weight)
            targets[f"{prefix}.post_attention_layernorm.weight"] = WeightTarget(
                layer.post_attention_layernorm.weight
            )
            qkv_rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
            suffixes = ["weight"] + (["bias"] if config.attention_bias else [])
            for name, (start, stop) in qkv_rows.items():
                for suffix in suffixes:
                    parameter = getattr(attn.qkv_proj, suffix)
                    targets[f"{prefix}.self_attn.{name}.{suffix}"] = WeightTarget(
                        parameter, start, stop
                    )
            targets[f"{prefix}.self_attn.o_proj.weight"] = WeightTarget(attn.o_proj.weight)
            if config.attention_output_bias:
                targets[f"{prefix}.self_attn.o_proj.bias"] = WeightTarget(attn.o_proj.bias)
            if attn.q_norm is not None and attn.k_norm is not None:
                targets[f"{prefix}.self_attn.q_norm.weight"] = WeightTarget(attn.q_norm.weight)
                targets[f"{prefix}.self_attn.k_norm.weight"] = WeightTarget(attn.k_norm.weight)
            mlp_suffixes = ["weight"] + (["bias"] if config.mlp_bias else [])
            for suffix in mlp_suffixes:
                fused = getattr(mlp.gate_up_proj, suffix)
                targets[f"{prefix}.mlp.gate_proj.{suffix}"] = WeightTarget(fused, 0, inter)
                targets[f"{prefix}.mlp.up_proj.{suffix}"] = WeightTarget(fused, inter, 2 * inter)
                targets[f"{prefix}.mlp.down_proj.{suffix}"] = WeightTarget(
                    getattr(mlp.down_proj, suffix)
                )
        return targets
