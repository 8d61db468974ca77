"""UCX settings the UCX transport applies to its own process, before ucxx initialises.

They are defaults (`os.environ.setdefault`): an operator's environment wins, except for ucxx's
progress mode, always "blocking" (no progress thread: `UcxProgress` drives the worker). Every
worker that imports `nori.transfer.ucx` gets them, so a benchmark and a deployment run the same
UCX.
What each one bought: docs/benchmarks.md#ucx-settings.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from types import MappingProxyType

UCX_ENV_DEFAULTS = MappingProxyType(
    {
        # ucxx opens endpoints with peer-failure error handling, and UCX then leaves its
        # shared-memory transports (sysv, posix) out unless they may run with error handling:
        # two workers on one host would silently talk over TCP loopback.
        "UCX_MM_ERROR_HANDLING": "y",
        # TCP segments of 1 MiB instead of 8 KiB (send) / 64 KiB (receive): far fewer syscalls
        # and protocol fragments per KV block.
        "UCX_TCP_TX_SEG_SIZE": "1M",
        "UCX_TCP_RX_SEG_SIZE": "1M",
        # Between workers on one host, every tagged message goes eager through the shared-
        # memory FIFO (copy-in, copy-out), never rendezvous: ucxx's UCX_RNDV_THRESH=8192 made
        # UCX move every KV block over 8 KiB by "rendezvous fragmented copy-in copy-out" (the
        # same two copies plus a handshake per message), and CMA, the one-copy path, is never
        # selected for these endpoints. Across hosts ucxx's 8 KiB stays.
        "UCX_RNDV_THRESH": "intra:inf,inter:8192",
        # ucxx sets UCX_MEMTYPE_CACHE, which UCX >= 1.19 no longer knows, so every process would
        # print an "unused environment variable" warning at start.
        "UCX_WARN_UNUSED_ENV_VARS": "n",
    }
)


def apply_ucx_env_defaults() -> None:
    for name, value in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    # Not a default: `UcxProgress` is the one thing that progresses the worker.
    os.environ["UCXPY_PROGRESS_MODE"] = "blocking"


# Linux's loopback interface, as UCX names network devices.
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
    """Keeps UCX's own sockets on the loopback interface when the worker binds there.

    UCX opens a listening TCP socket on every network device it uses (its TCP transport); a
    worker told `--host 127.0.0.1` (as `nori up` starts them) would still listen on the host's
    external interfaces (its receiver opens none: senders reach it by its worker address). For
    such a worker only
    `lo` is used (UCX_NET_DEVICES; the shared-memory transports are not network devices, so
    KV between workers on one host still moves through shared memory). A default, as the
    others: an operator's UCX_NET_DEVICES wins. Call it before UCX starts (the first receiver
    or sender).
    """
    names = {name for _, name in socket.if_nameindex()}
    if is_loopback(host) and LOOPBACK_DEVICE in names:
        os.environ.setdefault("UCX_NET_DEVICES", LOOPBACK_DEVICE)
