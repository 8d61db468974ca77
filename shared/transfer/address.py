"""Receiver addresses: "ucx://host:port" or "tcp://host:port" (IPv6 hosts in brackets), or
"ucx://host/PEER" for a UCX receiver reached by its worker address (no listening socket):
PEER is the receiver's hello tag (16 hex digits), a dash, and its UCX worker address in hex."""

from __future__ import annotations

import string
from dataclasses import dataclass

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
    """Raises ValueError for anything but "<scheme>://<host>:<port>" with a known scheme, or
    "ucx://<host>/<peer>"."""
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
