"""One rank's shard of a model: its shapes (`local_model_config`, what its KV cache holds) and
the cut itself, in place (`shard_model`, Megatron-style):

- attention: the rank's query heads and the kv heads they read, in the fused qkv projection
  (column-parallel); o_proj takes the matching input columns (row-parallel, summed over ranks);
- MLP: the rank's share of gate and up (column-parallel), down_proj's matching columns
  (row-parallel);
- the embedding and the LM head: the rank's share of the vocabulary.

Norms and rotary tables are small and kept whole. Runs right after the checkpoint is read and
before 8-bit quantization or prepacking, which then see plain nn.Linear shards.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from nori.models.config import ModelConfig
from nori.models.llama import CausalLM, DecoderLayer, GatedMLP, SelfAttention
from nori.parallel.group import TensorParallelGroup
from nori.parallel.layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelHead


def local_model_config(config: ModelConfig, group: TensorParallelGroup) -> ModelConfig:
    """The shapes `group`'s rank's shard has: its query and kv heads (what its KV cache holds).
    ValueError when the model does not split into world_size shards."""
    group.part(config.intermediate_size, "intermediate size")
    q_start, q_stop = group.part(config.num_attention_heads, "attention heads")
    kv_start, kv_stop = group.part(config.num_key_value_heads, "key-value heads")
    return replace(
        config,
        num_attention_heads=q_stop - q_start,
        num_key_value_heads=kv_stop - kv_start,
    )


def shard_model(model: CausalLM, group: TensorParallelGroup) -> None:
    config = model.config
    # Checked up front, so a bad size fails before anything is cut.
    local_model_config(config, group)
    with torch.no_grad():
        for layer in model.model.layers:
            assert isinstance(layer, DecoderLayer)
            _shard_attention(layer.self_attn, group)
            _shard_mlp(layer.mlp, group)
        embedding = model.model.embed_tokens
        model.head_module = VocabParallelHead(model.head_weight().data, group)
        model.model.embed_tokens = VocabParallelEmbedding(embedding, group)  # type: ignore[assignment]
        model.lm_head = None
        model.tied_head_weight = None


def _shard_attention(attn: SelfAttention, group: TensorParallelGroup) -> None:
    # Heads split evenly (checked), so the rank's share of q (and of k, v) is whole heads.
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
