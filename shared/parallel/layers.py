"""The modules a sharded model swaps in (Megatron-style). Column-parallel projections need none:
a rank keeps its weight rows in a plain nn.Linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nori.parallel.group import TensorParallelGroup


class RowParallelLinear(nn.Module):
    """Input features split over ranks (o_proj, down_proj): partial sums added, then the bias."""

    def __init__(
        self, inner: nn.Module, bias: torch.Tensor | None, group: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.inner = inner
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce_(self.inner(x))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds its vocabulary share's rows; other tokens look up zeros, so the sum over
    ranks is the full lookup."""

    def __init__(self, full: nn.Embedding, group: TensorParallelGroup) -> None:
        super().__init__()
        self.start, self.stop, _ = group.padded_part(full.num_embeddings)
        self.weight = nn.Parameter(
            full.weight.data[self.start : self.stop].clone(), requires_grad=False
        )
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.start) | (input_ids >= self.stop)
        local = (input_ids - self.start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside[:, None], 0.0)
        return self.group.all_reduce_(rows)


class VocabParallelHead(nn.Module):
    """The LM head split by vocabulary into equal shares (the last zero-padded, cut off after
    the gather), gathered side by side on every rank."""

    def __init__(self, full_weight: torch.Tensor, group: TensorParallelGroup) -> None:
        super().__init__()
        self.vocab_size, hidden = full_weight.shape
        start, stop, share = group.padded_part(self.vocab_size)
        weight_rows = torch.zeros(share, hidden, dtype=full_weight.dtype, device=full_weight.device)
        weight_rows[: stop - start] = full_weight[start:stop]
        vocab = share
        self.inner = nn.Linear(
            hidden, vocab, bias=False, dtype=weight_rows.dtype, device=weight_rows.device
        )
        self.inner.weight = nn.Parameter(weight_rows, requires_grad=False)
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.group.all_gather_last_dim(self.inner(hidden))
        return logits[:, : self.vocab_size]
