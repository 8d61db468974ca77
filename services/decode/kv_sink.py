"""Where incoming KV blocks land: the decode worker's own cache blocks, reserved under a lease.

Runs on the worker's event loop (the transport calls it there), so it needs no locks. A transfer
is accepted only for a request that is reserved right now, into exactly its reserved block ids,
with exactly the expected byte sizes: a late, duplicate or malformed transfer is refused and can
never write into blocks that belong to someone else.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nori.serving.kv_layout import destination_buffers
from nori.transfer.base import TransferHeader, TransferRejected


class LeaseState(enum.Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    ARRIVED = "arrived"
    FAILED = "failed"


@dataclass
class Lease:
    block_ids: list[int]
    expires_at: float
    state: LeaseState = LeaseState.RESERVED
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    done: asyncio.Event = field(default_factory=asyncio.Event)


class LeaseExpired(Exception):
    pass


class DecodeKVSink:
    def __init__(
        self,
        cache: torch.Tensor,
        transfer_timeout_s: float = 30.0,
        on_receiving: Callable[[str], None] | None = None,
    ) -> None:
        self._cache = cache
        # Told the request id when a transfer is accepted (the "transferring" request state).
        self._on_receiving = on_receiving
        # How long a transfer that has started may take after its lease ran out.
        self._transfer_timeout_s = transfer_timeout_s
        self._leases: dict[str, Lease] = {}
        self.bytes_received = 0
        self.transfers_completed = 0

    def expect(self, request_id: str, block_ids: list[int], lease_s: float) -> None:
        self._leases[request_id] = Lease(list(block_ids), time.monotonic() + lease_s)

    def forget(self, request_id: str) -> None:
        self._leases.pop(request_id, None)

    async def wait(self, request_id: str) -> dict[str, Any]:
        """The transfer's metadata once its blocks have all arrived.

        Raises LeaseExpired when nothing arrived in time (the lease is then gone, so a late
        sender is refused), or TransferRejected when the transfer broke off.
        """
        lease = self._leases[request_id]
        try:
            await asyncio.wait_for(lease.done.wait(), max(0.0, lease.expires_at - time.monotonic()))
        except TimeoutError:
            if lease.state is not LeaseState.RECEIVING:
                self.forget(request_id)
                raise LeaseExpired(
                    f"the KV blocks of request {request_id!r} did not arrive within the lease"
                ) from None
            # Bytes are landing in the blocks right now: they cannot be freed under the transport.
            await asyncio.wait_for(lease.done.wait(), self._transfer_timeout_s)
        if lease.state is LeaseState.FAILED:
            raise TransferRejected(
                f"the KV transfer of request {request_id!r} failed: {lease.error}"
            )
        return lease.metadata

    # ------------------------------------------------------------------ KVSink (transport)

    def destinations(self, header: TransferHeader) -> list[torch.Tensor]:
        lease = self._leases.get(header.request_id)
        if lease is None:
            raise TransferRejected(
                f"request {header.request_id!r} has no reserved blocks here "
                "(unknown, finished, or its lease expired)"
            )
        if lease.state is not LeaseState.RESERVED:
            raise TransferRejected(f"request {header.request_id!r} is already {lease.state.value}")
        if list(header.block_ids) != lease.block_ids:
            raise TransferRejected(
                f"block ids {list(header.block_ids)} differ from the reservation {lease.block_ids}"
            )
        buffers = destination_buffers(self._cache, lease.block_ids)
        expected = [buffer.nbytes for buffer in buffers]
        if list(header.buffer_nbytes) != expected:
            raise TransferRejected(
                f"buffer sizes {list(header.buffer_nbytes)} differ from this worker's KV layout "
                f"{expected} (same model, dtype and block size on both sides?)"
            )
        lease.state = LeaseState.RECEIVING
        if self._on_receiving is not None:
            self._on_receiving(header.request_id)
        return buffers

    def completed(self, header: TransferHeader, nbytes: int) -> None:
        self.bytes_received += nbytes
        self.transfers_completed += 1
        lease = self._leases.get(header.request_id)
        if lease is not None:
            lease.state = LeaseState.ARRIVED
            lease.metadata = dict(header.metadata)
            lease.done.set()

    def failed(self, header: TransferHeader, error: str) -> None:
        lease = self._leases.get(header.request_id)
        if lease is not None:
            lease.state = LeaseState.FAILED
            lease.error = error
            lease.done.set()
