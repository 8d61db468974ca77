"""The mixture-of-experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE: a router picks each token's
top-k experts, `nori.kernels.fused_moe` runs them, Qwen2-MoE adds a sigmoid-gated shared expert.

Routing follows transformers exactly. Ranks hold expert slices or whole experts
(`nori.models.shard`); one all-reduce adds their partial sums. `routed_tokens` counts per expert."""

from __future__ import annotations

import torch
from torch import nn

from nori.kernels.fused_moe import fused_experts, pack_expert_panels, unpack_expert_panels
from nori.kernels.quantized_linear import quantize_weight
from nori.models.config import ModelConfig
from nori.parallel.group import TensorParallelGroup


def route_tokens(
    router_logits: torch.Tensor, top_k: int, renormalise: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] in weights_dtype, expert ids [T, k] int64)."""
    probabilities = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probabilities, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


class ExpertWeights(nn.Module):
    """Every expert's gated MLP, stacked: w13 [E, 2I, H] (gate, then up rows) and w2 [E, H, I];
    8-bit after `quantize_`, packed in panels after `pack_for_cpu` (`gate_up_weights()` and
    `down_weights()` give [E, N, K] either way)."""

    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None

    def __init__(
        self,
        num_experts: int,
        intermediate_size: int,
        hidden_size: int,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(
            torch.empty(
                num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device
            ),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.register_buffer("w13_scale", None)
        self.register_buffer("w2_scale", None)

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor
    ) -> torch.Tensor:
        return fused_experts(
            hidden, self.w13, self.w2, topk_weights, local_ids, self.w13_scale, self.w2_scale
        )

    def keep_slices(self, experts: slice, intermediate_rows: torch.Tensor | None = None) -> None:
        """Keeps only `experts` and, of each, the `intermediate_rows` (tensor parallelism); in
        place, before any quantization."""
        w13, w2 = self.w13.data[experts], self.w2.data[experts]
        if intermediate_rows is not None:
            inter = self.intermediate_size
            gate_up_rows = torch.cat([intermediate_rows, inter + intermediate_rows])
            w13 = w13.index_select(1, gate_up_rows.to(w13.device))
            w2 = w2.index_select(2, intermediate_rows.to(w2.device))
            self.intermediate_size = int(intermediate_rows.numel())
        self.w13 = nn.Parameter(w13.contiguous(), requires_grad=False)
        self.w2 = nn.Parameter(w2.contiguous(), requires_grad=False)
        self.num_experts = w13.shape[0]

    def quantize_(self, method: str) -> None:
        """8-bit weights (int8 or fp8) with one scale per output row (`quantize_weight`)."""
        for name in ("w13", "w2"):
            weights = getattr(self, name)
            codes, scales = zip(
                *(quantize_weight(weights[e], method) for e in range(self.num_experts)),
                strict=True,
            )
            setattr(self, name, nn.Parameter(torch.stack(codes), requires_grad=False))
            setattr(self, f"{name}_scale", torch.stack(scales))

    def pack_for_cpu(self) -> None:
        """Packs both matrices in panels of 16 outputs, the C++ kernel's fastest route
        (docs/benchmarks.md#cpu-kernels-and-weight-layouts)."""
        for name in ("w13", "w2"):
            packed = pack_expert_panels(getattr(self, name).data)
            setattr(self, name, nn.Parameter(packed, requires_grad=False))

    def gate_up_weights(self) -> torch.Tensor:
        """w13 as [E, 2I, H], unpacked if packed (a copy then)."""
        if self.w13.dim() == 3:
            return self.w13.data
        return unpack_expert_panels(self.w13.data, 2 * self.intermediate_size)

    def down_weights(self) -> torch.Tensor:
        """w2 as [E, H, I], unpacked if packed (a copy then)."""
        if self.w2.dim() == 3:
            return self.w2.data
        return unpack_expert_panels(self.w2.data, self.w13.shape[2])


class SparseMoeBlock(nn.Module):
    """The MLP of a routed decoder layer, named as the Qwen MoE checkpoints (`gate` is the
    router [E, H]); Qwen2-MoE adds a shared expert and its one-output `shared_expert_gate`."""

    routed_tokens: torch.Tensor

    def __init__(
        self,
        config: ModelConfig,
        gate: nn.Module,
        experts: ExpertWeights,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.renormalise = config.norm_topk_prob
        self.weights_in_float32 = config.routing_weights_in_float32
        self.gate = gate
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        # Expert parallelism: this rank's experts are [expert_start, expert_start + local).
        self.expert_start = 0
        # Where the ranks' partial sums meet (set by `nori.models.shard`); None on one rank.
        self.group: TensorParallelGroup | None = None
        self.register_buffer(
            "routed_tokens",
            torch.zeros(config.num_experts, dtype=torch.int64, device=experts.w13.device),
            persistent=False,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden)
        weights_dtype = torch.float32 if self.weights_in_float32 else hidden.dtype
        weights, ids = route_tokens(router_logits, self.top_k, self.renormalise, weights_dtype)
        flat_ids = ids.flatten()
        self.routed_tokens.index_add_(0, flat_ids, torch.ones_like(flat_ids))
        local_ids = ids if self.group is None else ids - self.expert_start
        out = self.experts(hidden, weights, local_ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared_gate = torch.sigmoid(self.shared_expert_gate(hidden))
            out = out + shared_gate * self.shared_expert(hidden)
        if self.group is not None:
            out = self.group.all_reduce_(out)
        return out

    def reset_buffers(self) -> None:
        self.routed_tokens.zero_()
