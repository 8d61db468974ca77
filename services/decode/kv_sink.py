"""Where incoming KV blocks land: the decode worker's own cache blocks, reserved under a lease.

Runs on the worker's event loop only, so it needs no locks. A transfer is accepted only for a
live lease, carrying its transfer token, into exactly its reserved block ids with the expected
byte sizes: a late, duplicate, forged or malformed transfer can never write into or free
another's blocks. Lease timing is `lease.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable, Sequence

import torch

from nori.cluster_auth import random_token
from nori.decode.lease import Lease, LeaseExpired, LeasePolicy, LeaseState
from nori.transfer.base import TransferRejected
from nori.transfer.handoff import HandOff, TransferHeader
from nori.transfer.integrity import landed_mismatch
from nori.worker.kv_layout import BlockLayout, destination_buffers, staging_buffers

__all__ = ["DecodeKVSink", "LeaseExpired", "LeasePolicy"]


class DecodeKVSink:
    def __init__(
        self,
        cache: Sequence[torch.Tensor],
        transfer_timeout_s: float = 30.0,
        on_receiving: Callable[[str], None] | None = None,
        queue_timeout_s: float = 60.0,
        staging: Sequence[BlockLayout] | None = None,
    ) -> None:
        """`staging`: receive into fresh tensors of this layout instead of the cache (a
        tensor-parallel engine's, split over processes); `staged_blocks` hands them over."""
        self._staging = None if staging is None else tuple(staging)
        if isinstance(cache, torch.Tensor):
            raise TypeError("DecodeKVSink takes the KV cache's tensors (KVCache.tensors)")
        self._cache = tuple(cache)
        self._on_receiving = on_receiving
        self._transfer_timeout_s = transfer_timeout_s
        self._queue_timeout_s = queue_timeout_s
        self._leases: dict[str, Lease] = {}
        self.bytes_received = 0
        self.transfers_completed = 0
        self.checksum_failures = 0

    def expect(self, request_id: str, block_ids: list[int], lease_s: float) -> Lease:
        """Reserves `block_ids` for the request's KV under a lease; the sender's header must
        carry its epoch and transfer token. Both are random: a late sender of an earlier
        reservation never matches, and only the destination's holders know the token."""
        policy = LeasePolicy(lease_s, self._queue_timeout_s, self._transfer_timeout_s)
        lease = Lease.reserve(
            request_id,
            block_ids,
            policy,
            time.monotonic(),
            epoch=secrets.randbits(62),
            transfer_token=random_token(),
        )
        self._leases[request_id] = lease
        return lease

    def renew(self, request_id: str, started: bool) -> bool:
        """The prefill worker holding the prompt is alive (and `started` computing it); False
        when no live lease is held here (its holder stops renewing)."""
        lease = self._leases.get(request_id)
        return lease is not None and lease.renew(time.monotonic(), started)

    def state(self, request_id: str) -> LeaseState | None:
        lease = self._leases.get(request_id)
        return lease.state if lease is not None else None

    def lease(self, request_id: str) -> Lease | None:
        return self._leases.get(request_id)

    def num_receiving(self) -> int:
        """Transfers under way now (a copy, read from the metrics thread)."""
        return sum(
            1 for lease in list(self._leases.values()) if lease.state is LeaseState.RECEIVING
        )

    def forget(self, request_id: str) -> None:
        self._leases.pop(request_id, None)

    def staged_blocks(self, request_id: str) -> tuple[torch.Tensor, ...] | None:
        """A staging sink's received blocks of an arrived request (handed over once); None for a
        sink that receives into the cache."""
        lease = self._leases.get(request_id)
        if lease is None or lease.staged is None or lease.state is not LeaseState.ARRIVED:
            return None
        staged, lease.staged = lease.staged, None
        return staged

    async def wait(self, request_id: str) -> HandOff:
        """The transfer's hand-off once its blocks have all arrived. Raises LeaseExpired (the
        lease ran out first and is gone), TimeoutError, or TransferRejected (it broke off)."""
        lease = self._leases[request_id]
        while not lease.done.is_set():
            remaining = lease.deadline() - time.monotonic()
            if remaining <= 0:
                if lease.state is LeaseState.RECEIVING:
                    raise TimeoutError(
                        f"the KV transfer of request {request_id!r} did not finish within "
                        f"{lease.policy.transfer_timeout_s:g} s"
                    )
                self.forget(request_id)
                raise lease.expiry()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lease.done.wait(), remaining)
        if lease.state is LeaseState.FAILED:
            raise TransferRejected(
                f"the KV transfer of request {request_id!r} failed: {lease.error}"
            )
        assert lease.hand_off is not None
        return lease.hand_off

    def destinations(self, header: TransferHeader) -> list[torch.Tensor]:
        lease = self._leases.get(header.request_id)
        if lease is None:
            raise TransferRejected(
                f"request {header.request_id!r} has no reserved blocks here "
                "(unknown, finished, or its lease expired)"
            )
        # First, before any state changes: a sender without the token is refused.
        if not lease.admits(header.hand_off.destination.transfer_token):
            raise TransferRejected(
                f"the transfer of request {header.request_id!r} does not carry its "
                "reservation's transfer token"
            )
        if lease.state not in (LeaseState.QUEUED, LeaseState.COMPUTING):
            raise TransferRejected(f"request {header.request_id!r} is already {lease.state.value}")
        now = time.monotonic()
        if not lease.is_live(now):
            raise TransferRejected(f"the lease of request {header.request_id!r} has expired")
        if header.hand_off.destination.lease_epoch != lease.epoch:
            raise TransferRejected(
                f"the transfer names reservation {header.hand_off.destination.lease_epoch} of "
                f"request {header.request_id!r}, this worker holds reservation {lease.epoch}"
            )
        if list(header.block_ids) != lease.block_ids:
            raise TransferRejected(
                f"block ids {list(header.block_ids)} differ from the reservation {lease.block_ids}"
            )
        if self._staging is None:
            buffers = destination_buffers(self._cache, lease.block_ids)
        else:
            lease.staged, buffers = staging_buffers(self._staging, lease.block_ids)
        expected = [buffer.nbytes for buffer in buffers]
        if list(header.buffer_nbytes) != expected:
            raise TransferRejected(
                f"buffer sizes {list(header.buffer_nbytes)} differ from this worker's KV layout "
                f"{expected} (same model, dtype, --kv-cache-dtype and block size on both sides?)"
            )
        if not header.checksums_follow:
            raise TransferRejected("the header does not say a checksum follows the buffers")
        lease.start_receiving(now)
        if self._on_receiving is not None:
            self._on_receiving(header.request_id)
        return buffers

    def completed(self, header: TransferHeader, nbytes: int) -> None:
        """Every byte arrived: checked against the sender's checksums. A mismatch fails the
        request (freeing its blocks) and raises TransferRejected, so the sender is refused."""
        self.bytes_received += nbytes
        lease = self._receiving(header)
        if lease is None:
            return  # expired or failed meanwhile: its blocks are gone or going
        problem = (
            f"{nbytes} bytes arrived, {header.total_nbytes} expected"
            if nbytes != header.total_nbytes
            else landed_mismatch(header.received_checksums, header.buffer_checksums)
        )
        if problem is not None:
            self.checksum_failures += 1
            error = f"corrupted KV transfer: {problem}"
            self.failed(header, error)
            raise TransferRejected(error)
        self.transfers_completed += 1
        lease.state = LeaseState.ARRIVED
        lease.arrived_at = time.monotonic()
        lease.bulk = header.bulk
        lease.nbytes = nbytes
        lease.hand_off = header.hand_off
        lease.done.set()

    def failed(self, header: TransferHeader, error: str) -> None:
        lease = self._receiving(header)
        if lease is not None:
            lease.state = LeaseState.FAILED
            lease.error = error
            lease.done.set()

    def _receiving(self, header: TransferHeader) -> Lease | None:
        """The lease a transfer this sink accepted is landing in; None for any other header, so
        only the accepted sender can complete or fail a reservation."""
        lease = self._leases.get(header.request_id)
        if (
            lease is None
            or lease.state is not LeaseState.RECEIVING
            or not lease.admits(header.hand_off.destination.transfer_token)
        ):
            return None
        return lease
