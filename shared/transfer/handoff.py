"""The prefill-to-decode hand-off on the wire (`proto/nori/v1/handoff.proto`), its only codec.

A header starts with a magic and a version: a foreign or older peer is refused, not misread.
Receiver addresses: "ucx://host:port" or "tcp://host:port" (IPv6 hosts in brackets), or
"ucx://host/PEER" for a UCX receiver reached by its worker address (no listening socket): PEER
is the receiver's hello tag (16 hex digits), a dash, and its UCX worker address in hex."""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from google.protobuf.message import DecodeError

from nori.v1.handoff_pb2 import (
    CrossMemoryOffer,
    HandOff,
    KVDestination,
    KVTransferHeader,
    KVTransferReply,
)

__all__ = ["CrossMemoryOffer", "HandOff", "KVTransferReply"]  # re-exported

# How a transfer's bytes came: as messages, or copied out of the sender's shared memory.
KVBulk = Literal["messages", "mapped"]

# Bumped when the header's layout changes incompatibly, so a mixed deployment fails loudly.
HEADER_VERSION = 3
_MAGIC = b"NKV"


@dataclass(frozen=True)
class TransferHeader:
    hand_off: HandOff
    buffer_nbytes: tuple[int, ...]
    # The transfer's checksum (nori.transfer.integrity) comes after the buffers.
    checksums_follow: bool = False
    # Runs of adjacent source buffers; empty: none stated.
    source_runs: tuple[int, ...] = ()
    # The sender's shared-memory offer (`cross_memory_sender`); None: it sends the bytes.
    pull_offer: CrossMemoryOffer | None = None
    # Not on the wire (nor compared) from here on: the sender's and the receiving transport's
    # checksums, set by the receiving conversation for the sink to compare; how the bytes came.
    buffer_checksums: tuple[int, ...] = field(default=(), compare=False)
    received_checksums: tuple[int, ...] = field(default=(), compare=False)
    bulk: KVBulk = field(default="messages", compare=False)
    # A sender's checksum taken where the bytes were written (the export copy); None: hash them.
    sender_checksum: int | None = field(default=None, compare=False)

    @classmethod
    def of(
        cls,
        request_id: str,
        block_ids: Sequence[int],
        buffer_nbytes: Sequence[int],
        output_token_ids: Sequence[int] = (),
        generator_state: bytes | None = None,
        destination: KVDestination | None = None,
        trace_context: Mapping[str, str] | None = None,
        checksums_follow: bool = False,
        sender: str = "",
    ) -> TransferHeader:
        """A header for `block_ids` of `destination` (bare when None), from the `sender` worker."""
        where = KVDestination()
        if destination is not None:
            where.CopyFrom(destination)
        del where.block_ids[:]
        where.block_ids.extend(block_ids)
        hand_off = HandOff(
            request_id=request_id,
            destination=where,
            output_token_ids=list(output_token_ids),
            sender=sender,
        )
        if generator_state is not None:
            hand_off.generator_state = generator_state
        if trace_context:
            hand_off.trace_context.update(trace_context)
        return cls(hand_off, tuple(buffer_nbytes), checksums_follow)

    @property
    def request_id(self) -> str:
        return self.hand_off.request_id

    @property
    def block_ids(self) -> list[int]:
        return list(self.hand_off.destination.block_ids)

    @property
    def total_nbytes(self) -> int:
        return sum(self.buffer_nbytes)

    def to_bytes(self) -> bytes:
        message = KVTransferHeader(
            hand_off=self.hand_off,
            buffer_nbytes=list(self.buffer_nbytes),
            checksums_follow=self.checksums_follow,
            source_runs=list(self.source_runs),
            pull_offer=self.pull_offer,
        )
        return _MAGIC + bytes([HEADER_VERSION]) + message.SerializeToString()

    @classmethod
    def from_bytes(cls, data: bytes) -> TransferHeader:
        """Parses and checks a header; ValueError saying what is wrong if foreign or malformed."""
        if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 1:
            raise ValueError(
                "not a Nori KV transfer header (a different program, or a Nori older than "
                f"header version {HEADER_VERSION}?)"
            )
        version = data[len(_MAGIC)]
        if version != HEADER_VERSION:
            raise ValueError(
                f"header version {version} is not supported (this receiver speaks {HEADER_VERSION})"
            )
        message = KVTransferHeader()
        try:
            message.ParseFromString(data[len(_MAGIC) + 1 :])
        except DecodeError as error:
            raise ValueError(f"malformed transfer header: {error}") from None
        hand_off = message.hand_off
        if not hand_off.request_id:
            raise ValueError("header field 'request_id' must be a non-empty string")
        if any(block_id < 0 for block_id in hand_off.destination.block_ids):
            raise ValueError("header field 'block_ids' must not hold negative block ids")
        if any(size < 0 for size in message.buffer_nbytes):
            raise ValueError("header field 'buffer_nbytes' must not hold negative sizes")
        if message.buffer_checksums:
            raise ValueError("per-buffer checksums in the header are refused: the checksum follows")
        runs = tuple(message.source_runs)
        if runs and (min(runs) < 1 or sum(runs) != len(message.buffer_nbytes)):
            raise ValueError(
                f"header field 'source_runs' must be runs of at least 1 buffer adding up to "
                f"the {len(message.buffer_nbytes)} buffers"
            )
        offer = message.pull_offer if message.HasField("pull_offer") else None
        if offer is not None:
            if len(offer.region_addresses) != len(offer.region_nbytes):
                raise ValueError("header field 'pull_offer' has regions without sizes")
            if sum(offer.region_nbytes) != sum(message.buffer_nbytes):
                raise ValueError(
                    "header field 'pull_offer' offers regions that do not add up to the buffers"
                )
            segment_fields = (offer.segment_addresses, offer.segment_nbytes, offer.segment_keys)
            if len({len(values) for values in segment_fields}) != 1:
                raise ValueError("header field 'pull_offer' has segments without sizes or keys")
            if offer.segment_addresses and not offer.segment_socket:
                raise ValueError("header field 'pull_offer' has segments but no segment socket")
        return cls(hand_off, tuple(message.buffer_nbytes), message.checksums_follow, runs, offer)


def encode_reply(reply: KVTransferReply) -> bytes:
    return reply.SerializeToString()


def decode_reply(payload: bytes) -> KVTransferReply:
    """A receiver's reply; ValueError when it is not one (the peer does not speak this protocol)."""
    reply = KVTransferReply()
    try:
        reply.ParseFromString(payload)
    except DecodeError as error:
        raise ValueError(f"malformed reply: {error}") from None
    if reply.WhichOneof("kind") is None:
        raise ValueError("the reply says neither accepted, rejected nor done")
    return reply


SCHEMES = ("ucx", "tcp")
# A worker address is a few hundred bytes; far longer is not one.
_MAX_PEER_CHARS = 8192


@dataclass(frozen=True)
class Address:
    scheme: str
    host: str
    port: int
    # "ucx://host/PEER" only: the receiver's hello tag and worker address.
    peer: str = ""

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.peer:
            return f"{self.scheme}://{host}/{self.peer}"
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def brief(self) -> str:
        """For logs and spans: a worker address shortened to the receiver's hello tag."""
        if not self.peer:
            return str(self)
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}/{self.peer.partition('-')[0]}"

    @property
    def hello_tag(self) -> int:
        return int(self.peer.partition("-")[0], 16)

    @property
    def worker_address(self) -> bytes:
        return bytes.fromhex(self.peer.partition("-")[2])


def worker_peer(hello_tag: int, worker_address: bytes) -> str:
    return f"{hello_tag:016x}-{worker_address.hex()}"


def parse_address(address: str) -> Address:
    """ValueError unless "<scheme>://<host>:<port>" (a known scheme) or "ucx://<host>/<peer>"."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"transfer address {address!r} must start with ucx:// or tcp://")
    if scheme == "ucx" and "/" in rest:
        host, _, peer = rest.partition("/")
        tag, dash, worker = peer.partition("-")
        hex_digits = set(string.hexdigits)
        if (
            not host
            or len(tag) != 16
            or not dash
            or not worker
            or len(worker) % 2
            or len(peer) > _MAX_PEER_CHARS
            or not set(tag + worker) <= hex_digits
        ):
            raise ValueError(f"transfer address {address!r} has no valid UCX worker address")
        return Address(scheme, host.strip("[]"), 0, peer)
    host, colon, port_text = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"transfer address {address!r} must end with host:port")
    return Address(scheme, host, int(port_text))


def brief_address(address: str) -> str:
    """`Address.brief` of an address string; the string itself when it does not parse."""
    try:
        return parse_address(address).brief
    except ValueError:
        return address
