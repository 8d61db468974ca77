"""A decode-worker stand-in: a receiver in its own OS process, writing into shared KV caches.

The caches live in shared memory and are handed to the child at spawn, so the test process
checks the very tensors the child's sink handed out views of: bytes that went anywhere else
(a staging buffer, a copy) would not show up there.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from nori.transfer.base import TransferConfig, TransferRejected
from nori.transfer.handoff import TransferHeader

# [layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim], like nori.engine.kv_cache.
CACHE_SHAPE = (2, 2, 16, 4, 2, 8)
# Cache cells no transfer wrote to keep this value.
UNTOUCHED = -7.0


def make_caches() -> dict[str, torch.Tensor]:
    return {
        name: torch.full(CACHE_SHAPE, UNTOUCHED, dtype=dtype).share_memory_()
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
    }


def block_slices(cache: torch.Tensor, block_ids: list[int]) -> list[torch.Tensor]:
    """One contiguous [block_size, heads, dim] slice per (layer, K/V, block): header order."""
    layers, kv = cache.shape[:2]
    return [cache[layer, k, b] for layer in range(layers) for k in range(kv) for b in block_ids]


class CacheSink:
    """Receives into views of the cache its destination names; refuses on request ("reject ..."
    ids), hands out one block too few for "short-..." ids, and finds the arrived bytes bad for
    "bad-bytes..." ids (as a failed checksum would)."""

    def __init__(self, caches: dict[str, torch.Tensor]) -> None:
        self.caches = caches
        self.events: list[tuple[str, str, Any]] = []

    def destinations(self, header: TransferHeader) -> list[torch.Tensor]:
        if header.request_id.startswith("reject"):
            raise TransferRejected(f"unknown request {header.request_id}")
        if header.request_id.startswith("crash"):
            raise RuntimeError("the sink itself failed")
        cache = self.caches[header.hand_off.destination.worker_id or "float32"]
        if header.request_id.startswith("short"):
            # A sink that hands out the wrong blocks: one too few.
            return block_slices(cache, header.block_ids)[1:]
        return block_slices(cache, header.block_ids)

    def completed(self, header: TransferHeader, nbytes: int) -> None:
        if header.request_id.startswith("bad-bytes"):
            self.events.append(("failed", header.request_id, "bad bytes"))
            raise TransferRejected(f"corrupted KV transfer of {header.request_id}")
        self.events.append(("completed", header.request_id, nbytes))

    def failed(self, header: TransferHeader, error: str) -> None:
        self.events.append(("failed", header.request_id, error))


async def _serve(
    kind: str, caches: dict[str, torch.Tensor], conn: Connection, config: TransferConfig
) -> None:
    from nori.transfer.factory import make_receiver

    sink = CacheSink(caches)
    receiver = make_receiver(kind, sink, config)
    conn.send(await receiver.start(host="127.0.0.1"))
    loop = asyncio.get_running_loop()
    requests: asyncio.Queue[Any] = asyncio.Queue()
    loop.add_reader(conn.fileno(), lambda: requests.put_nowait(conn.recv()))
    while True:
        command = await requests.get()
        if command == "events":
            conn.send(
                {
                    "events": list(sink.events),
                    "bytes_received": receiver.bytes_received,
                    "transfers_completed": receiver.transfers_completed,
                    "bytes_mapped": receiver.bytes_mapped,
                }
            )
        elif command == "stop":
            loop.remove_reader(conn.fileno())
            await receiver.close()
            conn.send("stopped")
            return


def _main(
    kind: str, caches: dict[str, torch.Tensor], conn: Connection, config: TransferConfig
) -> None:
    asyncio.run(_serve(kind, caches, conn, config))


@dataclass
class ReceiverProcess:
    kind: str
    # "pull": the receiver copies senders' bytes out of their shared memory where it can (the
    # default); "messages": it never does (TransferConfig.map_shared_memory off).
    bulk: str
    address: str
    caches: dict[str, torch.Tensor]
    process: multiprocessing.process.BaseProcess
    conn: Connection

    @classmethod
    def start(cls, kind: str, bulk: str = "pull") -> ReceiverProcess:
        # torch's spawn context passes the shared-memory caches to the child without copying.
        import torch.multiprocessing as torch_mp

        context = torch_mp.get_context("spawn")
        caches = make_caches()
        conn, child_conn = context.Pipe()
        config = TransferConfig(map_shared_memory=bulk == "pull")
        process = context.Process(
            target=_main, args=(kind, caches, child_conn, config), daemon=True
        )
        process.start()
        if not conn.poll(60):
            process.kill()
            raise RuntimeError(f"the {kind} receiver process did not start")
        return cls(kind, bulk, conn.recv(), caches, process, conn)

    def status(self) -> dict[str, Any]:
        self.conn.send("events")
        if not self.conn.poll(30):
            raise RuntimeError("the receiver process does not answer")
        status: dict[str, Any] = self.conn.recv()
        return status

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send("stop")
                self.conn.poll(15)
            except OSError:
                pass
        self.process.join(15)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
