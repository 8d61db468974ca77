"""Reading Redis replies whether or not the client was made with decode_responses=True."""

from __future__ import annotations

from collections.abc import Mapping

# Mapping's key type is invariant: spell out the shapes callers and redis-py actually hand us.
RawMapping = Mapping[str, str] | Mapping[bytes, bytes] | Mapping[bytes | str, bytes | str]


def as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def as_str_mapping(mapping: RawMapping) -> dict[str, str]:
    return {as_str(key): as_str(value) for key, value in mapping.items()}
