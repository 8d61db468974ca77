"""Receiver addresses: "ucx://host:port" or "tcp://host:port" (IPv6 hosts in brackets)."""

from __future__ import annotations

from dataclasses import dataclass

SCHEMES = ("ucx", "tcp")


@dataclass(frozen=True)
class Address:
    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_address(address: str) -> Address:
    """Raises ValueError for anything but "<scheme>://<host>:<port>" with a known scheme."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"transfer address {address!r} must start with ucx:// or tcp://")
    host, colon, port_text = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"transfer address {address!r} must end with host:port")
    return Address(scheme, host, int(port_text))
