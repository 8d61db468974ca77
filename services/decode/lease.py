"""A reservation's lease: how long reserved blocks may wait for their KV, and who keeps them.

The prefill worker holding the prompt renews the lease (`RenewLeases`, at least three times per
lease) until its KV is sent; a dead one frees the blocks one lease later. QUEUED ends at the
last renewal + lease and at most `queue_timeout_s` after the reservation; COMPUTING at the last
renewal + lease; RECEIVING `transfer_timeout_s` after the transfer's start; ARRIVED and FAILED
are final. Pure logic on a monotonic clock the caller passes in.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nori.settings import DEFAULT_KV_LEASE_S
from nori.transfer.handoff import HandOff, KVBulk

if TYPE_CHECKING:
    import torch


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
