"""The prefill worker's export copy, as `nori.prefill.export_arena` makes it (gathered into
shared memory in 1 MiB chunks on the copy threads, the transfer checksum taken as it copies)
against the private copy it replaced (`nori.engine.kv_cache.read_blocks`: index_select), and
against that copy plus a separate checksum pass (what the sender's transport did before).

Usage: python -m nori.bench.export_copy [--blocks N] [--repeats R]   (prints one JSON object)

The cache is Llama-3-8B-like per layer (block_size 16, 8 KV heads, head_dim 128, bfloat16:
32 KiB per block and layer half) with 8 layers; N of its 1024 blocks are exported in a
scattered order. Figures are medians of the repeats, alternating the three ways.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nori.bench.moe_layer import cpu_model
from nori.engine.kv_cache import read_blocks
from nori.prefill.export_arena import ExportArena
from nori.transfer.integrity import TransferHasher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(8, 2, 1024, 16, 8, 128, generator=generator).to(torch.bfloat16)
    cache.share_memory_()  # as an engine process's cache is
    block_ids = torch.randperm(1024, generator=generator)[: args.blocks].tolist()
    arena = ExportArena()
    nbytes = 8 * 2 * args.blocks * 16 * 8 * 128 * 2

    def private() -> None:
        read_blocks((cache,), block_ids)

    def private_then_hashed() -> None:
        (copy,) = read_blocks((cache,), block_ids)
        hasher = TransferHasher()
        hasher.update(copy.view(torch.uint8).numpy())
        hasher.intdigest()

    def in_arena_hashed() -> None:
        copy = arena.read_blocks((cache,), block_ids)
        assert copy.release is not None and copy.checksum is not None
        copy.release()

    ways = {
        "private": private,
        "private_then_hashed": private_then_hashed,
        "arena_hashed": in_arena_hashed,
    }
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for repeat in range(args.repeats + 1):
        for name, way in ways.items() if repeat % 2 else reversed(ways.items()):
            start = time.perf_counter()
            way()
            if repeat:  # the first round warms up (page faults, threads)
                seconds[name].append(time.perf_counter() - start)
    report = {
        "cpu": cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "nbytes": nbytes,
        **{f"{name}_ms": round(statistics.median(s) * 1e3, 2) for name, s in seconds.items()},
        **{
            f"{name}_gbps": round(nbytes / statistics.median(s) / 1e9, 2)
            for name, s in seconds.items()
        },
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
