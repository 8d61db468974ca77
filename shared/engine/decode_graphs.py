"""CUDA graphs of the pure decode step's forward, one per bucketed batch size.

A decode step of B rows pads to the smallest captured size P >= B and replays that graph. The
graphs read the persistent step-input buffers in place (fixed addresses after capture) and write
the hidden states into a tensor of their own; all share one memory pool and are captured largest
first, after the KV cache is allocated, each after a warm-up run (Triton compiles there)."""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8, up to and including max_num_seqs (vLLM's buckets)."""
    sizes = {size for size in (1, 2, 4) if size < max_num_seqs}
    sizes.update(range(8, max_num_seqs, 8))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


class DecodeGraphs:
    """forward(size) runs the model over the first `size` rows of the step-input buffers and
    returns the hidden states [size, hidden]; `capture` records one graph per size."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes
        self._replays: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}

    def capture(self, forward: Callable[[int], torch.Tensor], device: torch.device) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_reserved(device)
        pool = None
        for size in reversed(self.sizes):
            forward(size)  # warm-up: compiles kernels, settles the allocator
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = forward(size)
            pool = graph.pool() if pool is None else pool
            self._replays[size] = (graph.replay, hidden)
        torch.cuda.synchronize(device)
        logger.info(
            "captured %d decode CUDA graphs (batch %d..%d) in %.1f s; graph memory %.0f MiB",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
            (torch.cuda.memory_reserved(device) - before) / 2**20,
        )

    def padded_size(self, batch: int) -> int | None:
        """The captured size a decode batch of `batch` rows runs at; None: larger than all."""
        index = bisect.bisect_left(self.sizes, batch)
        return self.sizes[index] if index < len(self.sizes) else None

    def replay(self, size: int) -> torch.Tensor:
        """Runs the graph of `size` on the buffers' current contents; its hidden states."""
        run, hidden = self._replays[size]
        run()
        return hidden
