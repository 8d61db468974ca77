"""The transport-neutral interface: errors, the sink, the endpoints and a transport's `Channel`
(the header is `handoff.py`'s). A `KVSender` pushes one request's KV blocks straight into a
`KVReceiver`'s paged cache, where its `KVSink.destinations` says."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from nori.transfer.handoff import TransferHeader

if TYPE_CHECKING:
    from nori.transfer.integrity import TransferHasher


class TransferRejected(Exception):
    """The receiver refused the transfer, in its own words; the connection stays usable."""


class TransferError(Exception):
    """The transfer failed in transport: connection refused or lost, timeout, protocol error."""


class ConnectionClosed(TransferError):
    """The peer closed the connection between messages (a normal end for a receiver)."""


class MessageTooLarge(TransferError):
    """A framed message exceeded the limit; the connection cannot be trusted afterwards."""


class HeaderPhaseError(TransferError):
    """The connection failed before the receiver answered the header: no data was sent, so a
    sender may retry on a fresh connection (a pooled one may have gone stale)."""


class Channel(Protocol):
    """One connection of a transport: framed messages both ways, one transfer at a time (the
    conversation over it: `conversation.py`)."""

    async def send_message(self, payload: bytes) -> None: ...

    async def recv_message(self, max_bytes: int) -> bytes:
        """One whole message. Raises ConnectionClosed (peer closed before it), MessageTooLarge,
        or TransferError."""
        ...

    async def send_buffers(
        self, views: list[torch.Tensor], hasher: TransferHasher | None = None
    ) -> None:
        """Sends flat uint8 views, all in flight at once, feeding `hasher` (if any) every byte."""
        ...

    async def recv_buffers(
        self, views: list[torch.Tensor], hasher: TransferHasher | None = None
    ) -> None:
        """Receives one message into each flat uint8 view, in place, feeding `hasher` (if
        given) every byte in order."""
        ...

    async def close(self) -> None:
        """Drops the connection; once it returns, nothing more is written into any buffer."""
        ...


@dataclass(frozen=True)
class TransferConfig:
    """Limits and timeouts shared by both transports."""

    connect_timeout_s: float = 5.0
    # Each later phase of one transfer (reply to the header; data and acknowledgement).
    timeout_s: float = 60.0
    # Connections (and so concurrent transfers) a sender keeps to one receiver.
    max_connections_per_peer: int = 4
    # Receivers drop connections with larger headers (bounded allocation).
    max_header_bytes: int = 1 << 20
    # On one host, copy out of the sender's shared memory where it maps; off: always messages.
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
        """Contiguous tensors to receive into, one per header buffer, same nbytes; raises
        TransferRejected to refuse."""
        ...

    def completed(self, header: TransferHeader, nbytes: int) -> None:
        """Every byte arrived; raises TransferRejected when the bytes fail a check (the sink has
        then failed the request) so the sender is refused."""
        ...

    def failed(self, header: TransferHeader, error: str) -> None:
        """The destinations were handed out but the data did not fully arrive (or was refused)."""
        ...


@runtime_checkable
class KVReceiver(Protocol):
    async def start(
        self, host: str = "0.0.0.0", port: int = 0, advertise_host: str = "127.0.0.1"
    ) -> str:
        """Starts taking transfers; returns the address senders use ("tcp://host:port", or
        "ucx://127.0.0.1/PEER" for a UCX receiver on loopback: `nori.transfer.handoff`)."""
        ...

    async def close(self) -> None: ...

    @property
    def address(self) -> str: ...

    @property
    def bytes_received(self) -> int: ...

    @property
    def transfers_completed(self) -> int: ...

    @property
    def bytes_mapped(self) -> int:
        """Bytes copied out of mappings of senders' shared memory."""
        ...


@runtime_checkable
class KVSender(Protocol):
    async def send(self, address: str, header: TransferHeader, buffers: list[torch.Tensor]) -> None:
        """Returns once the receiver acknowledged every byte. Raises TransferRejected or
        TransferError; ValueError (nothing sent) when the buffers do not match the header."""
        ...

    async def close(self) -> None: ...

    @property
    def bytes_sent(self) -> int: ...
