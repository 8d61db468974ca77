"""UCX settings the UCX transport applies to its own process, before ucxx initialises.

Defaults (`os.environ.setdefault`): an operator's environment wins, except the progress mode,
always "blocking" (`UcxProgress` drives the worker). Why: docs/benchmarks.md#ucx-settings."""

from __future__ import annotations

import ipaddress
import os
import socket
from types import MappingProxyType

UCX_ENV_DEFAULTS = MappingProxyType(
    {
        # Else UCX leaves shared memory out for error-handling endpoints (TCP loopback instead).
        "UCX_MM_ERROR_HANDLING": "y",
        # TCP segments of 1 MiB: far fewer syscalls and fragments per KV block.
        "UCX_TCP_TX_SEG_SIZE": "1M",
        "UCX_TCP_RX_SEG_SIZE": "1M",
        # On one host every message goes eager through the shared-memory FIFO, never
        # rendezvous; across hosts ucxx's 8 KiB stays.
        "UCX_RNDV_THRESH": "intra:inf,inter:8192",
        # ucxx sets UCX_MEMTYPE_CACHE, unknown to UCX >= 1.19: no warning at every start.
        "UCX_WARN_UNUSED_ENV_VARS": "n",
    }
)


def apply_ucx_env_defaults() -> None:
    for name, value in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    os.environ["UCXPY_PROGRESS_MODE"] = "blocking"


LOOPBACK_DEVICE = "lo"


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or "localhost") is this machine's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def confine_ucx_to(host: str) -> None:
    """Keeps UCX's own sockets on `lo` (UCX_NET_DEVICES) for a worker bound to loopback, unless
    the operator set UCX_NET_DEVICES. Call before UCX starts."""
    names = {name for _, name in socket.if_nameindex()}
    if is_loopback(host) and LOOPBACK_DEVICE in names:
        os.environ.setdefault("UCX_NET_DEVICES", LOOPBACK_DEVICE)
