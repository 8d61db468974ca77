"""The modules a sharded model swaps in (Megatron-style): what each rank holds and where the
ranks' partial results meet.

Column-parallel projections need no module of their own: a rank keeps its rows of the weight
(its heads of q/k/v, its share of gate/up) in a plain nn.Linear, and its outputs stay local.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nori.parallel.group import TensorParallelGroup


class RowParallelLinear(nn.Module):
    """A projection whose input features are split across the ranks (o_proj, down_proj): each
    rank multiplies its slice, the partial sums are added over the ranks, then the bias, once."""

    def __init__(
        self, inner: nn.Module, bias: torch.Tensor | None, group: TensorParallelGroup
    ) -> None:
        super().__init__()
        # An nn.Linear without bias, which 8-bit or prepacked modules may replace later.
        self.inner = inner
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce_(self.inner(x))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds the table rows of its share of the vocabulary; a token outside it looks
    up zeros, so the sum over the ranks is the full lookup."""

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
    """The LM head split by vocabulary: each rank's logits for its share, gathered side by side
    on every rank (the leader samples from them; the others take part in the gather).

    Shares are equal (the gather needs that): a vocabulary that does not split evenly gets zero
    rows at the end of the last share, whose logits are cut off after the gather.
    """

    def __init__(self, full_weight: torch.Tensor, group: TensorParallelGroup) -> None:
        super().__init__()
        self.vocab_size, hidden = full_weight.shape
        start, stop, share = group.padded_part(self.vocab_size)
        weight_rows = torch.zeros(share, hidden, dtype=full_weight.dtype, device=full_weight.device)
        weight_rows[: stop - start] = full_weight[start:stop]
        vocab = share
        # A plain nn.Linear, so prepacking or 8-bit quantization can replace it like any other.
        self.inner = nn.Linear(
            hidden, vocab, bias=False, dtype=weight_rows.dtype, device=weight_rows.device
        )
        self.inner.weight = nn.Parameter(weight_rows, requires_grad=False)
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.group.all_gather_last_dim(self.inner(hidden))
        return logits[:, : self.vocab_size]
