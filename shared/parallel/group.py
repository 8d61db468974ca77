"""One rank's view of the tensor-parallel group, and the collectives the sharded model uses.
torch.distributed's default group is per process, so a process holds at most one group."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    # Experts split whole across the ranks instead of sliced (attention is sharded either way).
    expert_parallel: bool = False

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def part(self, size: int, what: str) -> tuple[int, int]:
        """This rank's [start, stop) of `size` items split evenly; ValueError (naming `what`)
        when they do not split."""
        if size % self.world_size:
            raise ValueError(
                f"--tensor-parallel-size {self.world_size} must divide the model's {what} ({size})"
            )
        share = size // self.world_size
        return self.rank * share, (self.rank + 1) * share

    def padded_part(self, size: int) -> tuple[int, int, int]:
        """This rank's [start, stop) of `size` items in shares of ceil(size / world_size) (the
        last rank's may be short, or empty), and that share."""
        share = -(-size // self.world_size)
        start = min(self.rank * share, size)
        return start, min(start + share, size), share

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks in place and returns it (via float32 where gloo lacks
        the dtype)."""
        if tensor.dtype in (torch.float32, torch.float64) or tensor.is_cuda:
            dist.all_reduce(tensor)
            return tensor
        wide = tensor.float()
        dist.all_reduce(wide)
        tensor.copy_(wide)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` side by side along the last dimension (rank order)."""
        return torch.cat(self._all_gather(tensor), dim=-1)

    def gather_dim(self, tensor: torch.Tensor, dim: int) -> torch.Tensor | None:
        """Every rank's `tensor` concatenated along `dim` on rank 0 (None elsewhere)."""
        parts = self._all_gather(tensor)
        return torch.cat(parts, dim=dim) if self.is_leader else None

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        # As bytes: gloo has no float8 nor bfloat16 collectives; the parts view back whole.
        payload = tensor.contiguous().view(torch.uint8)
        parts = [torch.empty_like(payload) for _ in range(self.world_size)]
        dist.all_gather(parts, payload)
        return [part.view(tensor.dtype) for part in parts]

    def broadcast_object(self, value: object = None) -> object:
        """Rank 0's `value` on every rank (pickled; tensors go as CPU bytes)."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values (the KV pool every rank can hold)."""
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())
