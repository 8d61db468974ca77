"""The transport-neutral interface: the errors, the sink and the endpoints (the header they carry
is `handoff.py`'s).

A prefill worker (`KVSender`) pushes one request's KV blocks into the paged KV cache of a decode
worker (`KVReceiver`). The decode worker decides where the bytes land (`KVSink.destinations`),
so the receiver writes straight into the cache tensors; only small pieces scattered over a host
cache pass through a staging buffer of the receiving connection on their way (fewer, larger
messages: `buffers.ScatteredRun`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from nori.transfer.handoff import TransferHeader


class TransferRejected(Exception):
    """The receiver refused the transfer (unknown request, expired lease, size mismatch, ...).

    The message is the receiver's own words. A rejection leaves the connection usable.
    """


class TransferError(Exception):
    """The transfer failed in transport: connection refused or lost, timeout, protocol error."""


@dataclass(frozen=True)
class TransferConfig:
    """Limits and timeouts shared by both transports."""

    # Opening a connection, including UCX's endpoint handshake.
    connect_timeout_s: float = 5.0
    # Each later phase of one transfer: the receiver's reply to a header, then the data and the
    # final acknowledgement. Bounded so a frozen peer turns into a TransferError, not a hang.
    timeout_s: float = 60.0
    # Connections a sender keeps to one receiver; that many transfers to it run concurrently.
    max_connections_per_peer: int = 4
    # Receivers refuse (and drop the connection of) larger headers: a bad peer cannot make a
    # receiver allocate unbounded memory.
    max_header_bytes: int = 1 << 20
    # Between workers on one host, the receiver copies the bytes out of its mapping of the
    # sender's shared memory (one copy, instead of the messages' two) wherever it can map it
    # (`nori.transfer.cross_memory_receiver`); off: always messages.
    map_shared_memory: bool = True

    def __post_init__(self) -> None:
        if self.connect_timeout_s <= 0 or self.timeout_s <= 0:
            raise ValueError("transfer timeouts must be > 0")
        if self.max_connections_per_peer < 1:
            raise ValueError("max_connections_per_peer must be >= 1")
        if self.max_header_bytes < 1024:
            raise ValueError("max_header_bytes must be >= 1024")


@runtime_checkable
class KVSink(Protocol):
    """Implemented by the decode worker; called on the receiver's event loop."""

    def destinations(self, header: TransferHeader) -> list[torch.Tensor]:
        """Contiguous CPU (or CUDA) tensors to receive into, one per header buffer, same nbytes.

        Raises TransferRejected to refuse.
        """
        ...

    def completed(self, header: TransferHeader, nbytes: int) -> None:
        """Every byte arrived in the destinations.

        Raises TransferRejected when the bytes fail a check (the sink has then failed the
        request itself): the sender is told, instead of acknowledged.
        """
        ...

    def failed(self, header: TransferHeader, error: str) -> None:
        """The destinations were handed out but the data did not fully arrive (or was refused)."""
        ...


@runtime_checkable
class KVReceiver(Protocol):
    async def start(
        self, host: str = "0.0.0.0", port: int = 0, advertise_host: str = "127.0.0.1"
    ) -> str:
        """Starts taking transfers; returns the address senders use: "tcp://10.0.0.5:41234", or
        for a UCX receiver on loopback "ucx://127.0.0.1/PEER" (its worker address, no socket of
        its own; `nori.transfer.address`)."""
        ...

    async def close(self) -> None: ...

    @property
    def address(self) -> str: ...

    @property
    def bytes_received(self) -> int:
        """Bytes of fully received transfers."""
        ...

    @property
    def transfers_completed(self) -> int: ...

    @property
    def bytes_mapped(self) -> int:
        """Bytes copied out of mappings of senders' shared memory, not received as messages."""
        ...


@runtime_checkable
class KVSender(Protocol):
    async def send(self, address: str, header: TransferHeader, buffers: list[torch.Tensor]) -> None:
        """Returns once the receiver acknowledged every byte.

        Raises TransferRejected or TransferError; ValueError when the buffers do not match the
        header (nothing is sent then).
        """
        ...

    async def close(self) -> None: ...

    @property
    def bytes_sent(self) -> int:
        """Bytes of transfers the receiver acknowledged."""
        ...
