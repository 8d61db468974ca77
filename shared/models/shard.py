"""One rank's shard of a model, Megatron-style: its shapes (`local_model_config`) and the cut
itself, in place (`shard_model`).

Attention keeps the rank's heads, the MLP its share of gate/up and down's matching columns, a MoE
MLP every expert's share (or whole experts under expert parallelism), embedding and head their
vocabulary share; norms and rotary stay whole. Runs before 8-bit quantization or prepacking."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from nori.models.config import ModelConfig
from nori.models.llama import CausalLM, DecoderLayer, GatedMLP, SelfAttention
from nori.models.moe import SparseMoeBlock
from nori.parallel.group import TensorParallelGroup
from nori.parallel.layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelHead


def local_model_config(config: ModelConfig, group: TensorParallelGroup) -> ModelConfig:
    """The shapes of `group`'s rank's shard (its query and kv heads); ValueError when the model
    does not split into world_size shards."""
    if not config.is_moe or any(
        not config.is_moe_layer(index) for index in range(config.num_hidden_layers)
    ):
        group.part(config.intermediate_size, "intermediate size")
    if config.is_moe:
        if group.expert_parallel:
            group.part(config.num_experts, "experts (--enable-expert-parallel)")
        else:
            group.part(config.moe_intermediate_size, "expert intermediate size")
        if config.shared_expert_intermediate_size:
            group.part(config.shared_expert_intermediate_size, "shared expert intermediate size")
    q_start, q_stop = group.part(config.num_attention_heads, "attention heads")
    kv_start, kv_stop = group.part(config.num_key_value_heads, "key-value heads")
    return replace(
        config,
        num_attention_heads=q_stop - q_start,
        num_key_value_heads=kv_stop - kv_start,
    )


def shard_model(model: CausalLM, group: TensorParallelGroup) -> None:
    config = model.config
    local_model_config(config, group)
    with torch.no_grad():
        for layer in model.model.layers:
            assert isinstance(layer, DecoderLayer)
            _shard_attention(layer.self_attn, group)
            if isinstance(layer.mlp, SparseMoeBlock):
                _shard_moe(layer.mlp, group)
            else:
                _shard_mlp(layer.mlp, group)
        embedding = model.model.embed_tokens
        model.head_module = VocabParallelHead(model.head_weight().data, group)
        model.model.embed_tokens = VocabParallelEmbedding(embedding, group)  # type: ignore[assignment]
        model.lm_head = None
        model.tied_head_weight = None


def _shard_attention(attn: SelfAttention, group: TensorParallelGroup) -> None:
    q_start, q_stop = group.part(attn.q_size, "attention heads")
    kv_start, kv_stop = group.part(attn.kv_size, "key-value heads")
    q_size, kv_size = attn.q_size, attn.kv_size
    rows = torch.cat(
        [
            torch.arange(q_start, q_stop),
            q_size + torch.arange(kv_start, kv_stop),
            q_size + kv_size + torch.arange(kv_start, kv_stop),
        ]
    ).to(attn.qkv_proj.weight.device)
    attn.qkv_proj = _rows_of(attn.qkv_proj, rows)
    attn.o_proj = _row_parallel(attn.o_proj, q_start, q_stop, group)  # type: ignore[assignment]
    attn.num_heads //= group.world_size
    attn.num_kv_heads //= group.world_size
    attn.q_size, attn.kv_size = q_stop - q_start, kv_stop - kv_start


def _shard_mlp(mlp: GatedMLP, group: TensorParallelGroup) -> None:
    start, stop = group.part(mlp.intermediate_size, "intermediate size")
    inter = mlp.intermediate_size
    device = mlp.gate_up_proj.weight.device
    rows = torch.cat([torch.arange(start, stop), inter + torch.arange(start, stop)]).to(device)
    mlp.gate_up_proj = _rows_of(mlp.gate_up_proj, rows)
    mlp.down_proj = _row_parallel(mlp.down_proj, start, stop, group)  # type: ignore[assignment]
    mlp.intermediate_size = stop - start


def _shard_moe(block: SparseMoeBlock, group: TensorParallelGroup) -> None:
    experts = block.experts
    if group.expert_parallel:
        start, stop = group.part(experts.num_experts, "experts")
        experts.keep_slices(slice(start, stop))
        block.expert_start = start
    else:
        start, stop = group.part(experts.intermediate_size, "expert intermediate size")
        experts.keep_slices(slice(None), torch.arange(start, stop))
    shared = block.shared_expert
    if isinstance(shared, GatedMLP):
        # No all-reduce of down's own: the block all-reduces routed and shared sums together.
        start, stop = group.part(shared.intermediate_size, "shared expert intermediate size")
        inter = shared.intermediate_size
        device = shared.gate_up_proj.weight.device
        rows = torch.cat([torch.arange(start, stop), inter + torch.arange(start, stop)])
        shared.gate_up_proj = _rows_of(shared.gate_up_proj, rows.to(device))
        down = shared.down_proj
        columns = nn.Linear(stop - start, down.out_features, bias=False, dtype=down.weight.dtype)
        columns.weight = nn.Parameter(
            down.weight.data[:, start:stop].contiguous(), requires_grad=False
        )
        shared.down_proj = columns
        shared.intermediate_size = stop - start
    block.group = group


def _rows_of(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A column-parallel shard: the output features `rows` of `linear` (weight rows)."""
    weight = linear.weight.data.index_select(0, rows)
    shard = nn.Linear(
        weight.shape[1],
        weight.shape[0],
        bias=linear.bias is not None,
        dtype=weight.dtype,
        device=weight.device,
    )
    shard.weight = nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        shard.bias = nn.Parameter(linear.bias.data.index_select(0, rows), requires_grad=False)
    return shard


def _row_parallel(
    linear: nn.Linear, start: int, stop: int, group: TensorParallelGroup
) -> RowParallelLinear:
    """A row-parallel shard: input features [start, stop) of `linear` (weight columns)."""
    weight = linear.weight.data[:, start:stop].contiguous()
    inner = nn.Linear(
        weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype, device=weight.device
    )
    inner.weight = nn.Parameter(weight, requires_grad=False)
    bias = None if linear.bias is None else linear.bias.data.clone()
    return RowParallelLinear(inner, bias, group)
