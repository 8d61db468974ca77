"""One decoder for Llama 2/3, Mistral, Qwen2, Qwen3 and the MoE relatives Mixtral, Qwen2-MoE and
Qwen3-MoE (routed MLPs from `nori.models.moe`); config flags select the differences.

Tokens of all sequences are flattened into one axis T; only the `attention` callable knows which
belong together. q/k/v and gate/up are fused (`hf_weight_targets` maps the checkpoint's tensors)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nori.kernels.silu_and_mul import silu_and_mul
from nori.models.attention import Attention
from nori.models.config import ModelConfig
from nori.models.moe import ExpertWeights, SparseMoeBlock
from nori.models.rmsnorm import RMSNorm
from nori.models.rope import RotaryEmbedding, RotaryTables


@dataclass(frozen=True)
class WeightTarget:
    """Rows [start, stop) of `parameter` (all if None), or of its `expert`-th stacked matrix."""

    parameter: torch.Tensor
    start: int | None = None
    stop: int | None = None
    expert: int | None = None

    def view(self) -> torch.Tensor:
        data = self.parameter.data if self.expert is None else self.parameter.data[self.expert]
        if self.start is None:
            return data
        return data[self.start : self.stop]


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

    def forward(self, x: torch.Tensor, rotary: RotaryTables, attention: Attention) -> torch.Tensor:
        tokens, num_heads, num_kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        # One view of the fused projection as heads [T, Hq + 2 Hkv, D]; q, k, v are views of it.
        heads = self.qkv_proj(x).view(tokens, num_heads + 2 * num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = heads.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
            q = rotary.apply(self.q_norm(q)[0])
            k = rotary.apply(self.k_norm(k)[0])
        else:
            qk, v = heads.split([num_heads + num_kv_heads, num_kv_heads], dim=1)
            q, k = rotary.apply(qk).split([num_heads, num_kv_heads], dim=1)
        out = attention(self.layer_index, q, k, v, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig, make: _Factory, intermediate_size: int = 0) -> None:
        """`intermediate_size` 0: the config's."""
        super().__init__()
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = make.linear(
            config.hidden_size, 2 * self.intermediate_size, config.mlp_bias
        )
        self.down_proj = make.linear(self.intermediate_size, config.hidden_size, config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, make: _Factory) -> None:
        super().__init__()
        self.input_layernorm = make.norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_index, make)
        self.post_attention_layernorm = make.norm(config.hidden_size, config.rms_norm_eps)
        self.mlp: GatedMLP | SparseMoeBlock = (
            _moe_block(config, make) if config.is_moe_layer(layer_index) else GatedMLP(config, make)
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryTables,
        attention: Attention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings for layer 0, with no residual).
        Returns its MLP output and the residual before it (each add fuses into the next norm)."""
        hidden, residual = self.input_layernorm(x, residual)
        hidden, residual = self.post_attention_layernorm(
            self.self_attn(hidden, rotary, attention), residual
        )
        return self.mlp(hidden), residual


def _moe_block(config: ModelConfig, make: _Factory) -> SparseMoeBlock:
    shared = config.shared_expert_intermediate_size
    return SparseMoeBlock(
        config,
        gate=make.linear(config.hidden_size, config.num_experts, False),
        experts=ExpertWeights(
            config.num_experts,
            config.moe_intermediate_size,
            config.hidden_size,
            make.dtype,
            make.device,
        ),
        shared_expert=GatedMLP(config, make, intermediate_size=shared) if shared else None,
        shared_expert_gate=make.linear(config.hidden_size, 1, False) if shared else None,
    )


class DecoderStack(nn.Module):
    """Named `model` inside `CausalLM` so parameter names follow Hugging Face's."""

    def __init__(self, config: ModelConfig, make: _Factory) -> None:
        super().__init__()
        # Given its (uninitialised) weight: a random init on "meta" imports torch._dynamo (~1 s).
        weight = torch.empty(
            (config.vocab_size, config.hidden_size), dtype=make.dtype, device=make.device
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
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
        # would come apart when built on "meta" and materialized with to_empty.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else make.linear(config.hidden_size, config.vocab_size, False)
        )
        self.tied_head_weight: torch.Tensor | None = None
        # Used instead of a weight when set: 8-bit or CPU-prepacked head (quantization.py).
        self.head_module: nn.Module | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        rotary = self.rotary(positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rotary, attention)
        return self.model.norm(x, residual)[0]

    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]; call on the rows you sample from."""
        if self.head_module is not None:
            logits: torch.Tensor = self.head_module(hidden)
            return logits.float()
        if self.lm_head is not None:
            weight = self.lm_head.weight
        elif self.tied_head_weight is not None:
            weight = self.tied_head_weight
        else:
            weight = self.model.embed_tokens.weight
        return F.linear(hidden, weight).float()

    def store_weights_transposed(self) -> None:
        """On CPU, after loading: every projection's weight in [in, out] memory order (still seen
        as [out, in]), bit-identical (docs/benchmarks.md#cpu-kernels-and-weight-layouts)."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    transposed = module.weight.t().contiguous().t()
                    module.weight = nn.Parameter(transposed, requires_grad=False)
                elif isinstance(module, ExpertWeights):
                    module.pack_for_cpu()
            if self.lm_head is None and self.head_module is None:
                # Tied: the head gets its own transposed copy (the lookup wants rows contiguous).
                embedding = self.model.embed_tokens.weight
                self.tied_head_weight = embedding.t().contiguous().t()

    def reset_buffers(self) -> None:
        """Refills derived buffers after `to_empty` (which leaves them uninitialized)."""
        self.rotary.reset_buffers()
        for block in self.moe_blocks().values():
            block.reset_buffers()

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        blocks: dict[int, SparseMoeBlock] = {}
        for index, layer in enumerate(self.model.layers):
            assert isinstance(layer, DecoderLayer)
            if isinstance(layer.mlp, SparseMoeBlock):
                blocks[index] = layer.mlp
        return blocks

    def hf_weight_targets(self) -> dict[str, WeightTarget]:
        config = self.config
        targets: dict[str, WeightTarget] = {
            "model.embed_tokens.weight": WeightTarget(self.model.embed_tokens.weight),
            "model.norm.weight": WeightTarget(self.model.norm.weight),
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = WeightTarget(self.lm_head.weight)
        q, kv = config.q_size, config.kv_size
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
            if isinstance(mlp, SparseMoeBlock):
                targets.update(_moe_targets(config, prefix, mlp))
            else:
                targets.update(_mlp_targets(config, f"{prefix}.mlp", mlp))
        return targets


def _mlp_targets(config: ModelConfig, prefix: str, mlp: GatedMLP) -> dict[str, WeightTarget]:
    inter = mlp.intermediate_size
    targets: dict[str, WeightTarget] = {}
    for suffix in ["weight"] + (["bias"] if config.mlp_bias else []):
        fused = getattr(mlp.gate_up_proj, suffix)
        targets[f"{prefix}.gate_proj.{suffix}"] = WeightTarget(fused, 0, inter)
        targets[f"{prefix}.up_proj.{suffix}"] = WeightTarget(fused, inter, 2 * inter)
        targets[f"{prefix}.down_proj.{suffix}"] = WeightTarget(getattr(mlp.down_proj, suffix))
    return targets


def _moe_targets(
    config: ModelConfig, prefix: str, block: SparseMoeBlock
) -> dict[str, WeightTarget]:
    """Each expert's three matrices into its slices of the stacked weights. Mixtral calls the
    block `block_sparse_moe` and the matrices w1 (gate), w3 (up), w2 (down)."""
    inter = block.experts.intermediate_size
    w13, w2 = block.experts.w13, block.experts.w2
    if config.architecture == "MixtralForCausalLM":
        block_prefix, names = f"{prefix}.block_sparse_moe", ("w1", "w3", "w2")
    else:
        block_prefix, names = f"{prefix}.mlp", ("gate_proj", "up_proj", "down_proj")
    assert isinstance(block.gate, nn.Linear)
    targets = {f"{block_prefix}.gate.weight": WeightTarget(block.gate.weight)}
    for expert in range(block.num_experts):
        expert_prefix = f"{block_prefix}.experts.{expert}"
        gate_name, up_name, down_name = names
        targets[f"{expert_prefix}.{gate_name}.weight"] = WeightTarget(w13, 0, inter, expert)
        targets[f"{expert_prefix}.{up_name}.weight"] = WeightTarget(w13, inter, 2 * inter, expert)
        targets[f"{expert_prefix}.{down_name}.weight"] = WeightTarget(w2, expert=expert)
    if isinstance(block.shared_expert, GatedMLP) and isinstance(
        block.shared_expert_gate, nn.Linear
    ):
        targets.update(_mlp_targets(config, f"{block_prefix}.shared_expert", block.shared_expert))
        targets[f"{block_prefix}.shared_expert_gate.weight"] = WeightTarget(
            block.shared_expert_gate.weight
        )
    return targets
