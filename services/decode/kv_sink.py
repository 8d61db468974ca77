"""Where incoming KV blocks land: the decode worker's own cache blocks, reserved under a lease
the prefill worker renews (`RenewLeases`, at least three times a lease) until its KV is sent.

QUEUED ends at the last renewal + lease and at most `queue_timeout_s` after the reservation;
COMPUTING at the last renewal + lease; RECEIVING `transfer_timeout_s` after the transfer's start;
ARRIVED and FAILED are final. Event loop only (no locks). A transfer is accepted only for a live
lease with its transfer token, into exactly its reserved block ids with the expected byte sizes."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hmac
import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from nori.cluster_auth import random_token
from nori.settings import DEFAULT_KV_LEASE_S
from nori.transfer.base import TransferRejected
from nori.transfer.handoff import HandOff, KVBulk, TransferHeader
from nori.transfer.integrity import landed_mismatch
from nori.worker.servicer_base import BlockLayout, destination_buffers, staging_buffers


class LeaseState(enum.Enum):
    QUEUED = "queued"
    COMPUTING = "computing"
    RECEIVING = "receiving"
    ARRIVED = "arrived"
    FAILED = "failed"


_WAITING_FOR_KV = frozenset({LeaseState.QUEUED, LeaseState.COMPUTING})


@dataclass(frozen=True)
class LeasePolicy:
    lease_s: float = DEFAULT_KV_LEASE_S
    # Longest wait from the reservation until a prefill engine starts the prompt.
    queue_timeout_s: float = 60.0
    # Longest transfer, from the receiver's acceptance of its header to the last byte.
    transfer_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if min(self.lease_s, self.queue_timeout_s, self.transfer_timeout_s) <= 0:
            raise ValueError(f"lease timeouts must be positive: {self}")


class LeaseExpired(Exception):
    """The reservation ran out before its KV arrived; its blocks are to be freed."""


@dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    policy: LeasePolicy
    reserved_at: float
    renewed_at: float
    num_renewals: int = 0
    state: LeaseState = LeaseState.QUEUED
    receiving_since: float = 0.0
    arrived_at: float = 0.0
    nbytes: int = 0
    bulk: KVBulk = "messages"
    epoch: int = 0  # random; the sender's header must name it
    # The reservation's secret, handed out only in its KVDestination.
    transfer_token: str = field(default="", repr=False)
    # A staging sink's tensors the blocks arrive in, until handed to the engine.
    staged: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)
    hand_off: HandOff | None = None
    error: str = ""
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def reserve(
        cls,
        request_id: str,
        block_ids: list[int],
        policy: LeasePolicy,
        now: float,
        epoch: int = 0,
        transfer_token: str = "",
    ) -> Lease:
        return cls(
            request_id,
            list(block_ids),
            policy,
            reserved_at=now,
            renewed_at=now,
            epoch=epoch,
            transfer_token=transfer_token,
        )

    def admits(self, transfer_token: str) -> bool:
        """Whether a transfer carrying `transfer_token` came from whom this reservation was
        handed to (constant-time comparison)."""
        return bool(self.transfer_token) and hmac.compare_digest(
            transfer_token.encode(), self.transfer_token.encode()
        )

    @property
    def queue_deadline(self) -> float:
        return self.reserved_at + self.policy.queue_timeout_s

    def deadline(self) -> float:
        """When the reservation runs out unless something happens first."""
        if self.state is LeaseState.RECEIVING:
            return self.receiving_since + self.policy.transfer_timeout_s
        if self.state not in _WAITING_FOR_KV:
            return math.inf
        deadline = self.renewed_at + self.policy.lease_s
        if self.state is LeaseState.QUEUED:
            deadline = min(deadline, self.queue_deadline)
        return deadline

    def is_live(self, now: float) -> bool:
        return now < self.deadline()

    def renew(self, now: float, started: bool) -> bool:
        """A renewal from the prefill worker; False when the lease is over (stop renewing). A
        renewal after the deadline never revives the lease."""
        if self.state in (LeaseState.ARRIVED, LeaseState.FAILED) or not self.is_live(now):
            return False
        if self.state in _WAITING_FOR_KV:
            self.renewed_at = now
            self.num_renewals += 1
            if started:
                self.state = LeaseState.COMPUTING
        return True

    def start_receiving(self, now: float) -> None:
        self.state = LeaseState.RECEIVING
        self.receiving_since = now

    def expiry(self) -> LeaseExpired:
        """Why the lease ran out, for a lease whose deadline has passed while waiting for KV."""
        request = repr(self.request_id)
        lease_s = f"{self.policy.lease_s:g}"
        if self.state is LeaseState.QUEUED and self.queue_deadline <= self.deadline():
            return LeaseExpired(
                f"the prompt of request {request} waited more than "
                f"{self.policy.queue_timeout_s:g} s in the prefill queue without being started "
                "(the prefill worker is alive but its queue does not move); its reserved KV "
                "blocks were freed"
            )
        if self.num_renewals == 0:
            return LeaseExpired(
                f"the KV blocks of request {request} did not arrive within the lease: no prefill "
                f"worker took the prompt up within {lease_s} s of the reservation"
            )
        return LeaseExpired(
            f"the KV blocks of request {request} did not arrive within the lease: its prefill "
            f"worker stopped renewing it for {lease_s} s (hung or dead) while the prompt was "
            f"{self.state.value}"
        )


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
        carry its epoch and transfer token (both random)."""
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
