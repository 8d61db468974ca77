"""UCX settings the UCX transport applies to its own process, before ucxx initialises.

They are defaults (`os.environ.setdefault`): an operator's environment always wins. Every worker
that imports `nori.transfer.ucx` gets them, so a benchmark and a deployment run the same UCX.
The figures below are from two processes on one 2-core host, 64 MiB in 256 KiB blocks (raw
ucxx, before the rest of the transport's tuning), except where they say otherwise.
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
        # two workers on one host silently talked over TCP loopback (~3.5 GB/s instead of ~8).
        "UCX_MM_ERROR_HANDLING": "y",
        # TCP segments of 1 MiB instead of 8 KiB (send) / 64 KiB (receive): far fewer syscalls
        # and protocol fragments per KV block; UCX over TCP went from ~0.7 to ~3.4 GB/s.
        "UCX_TCP_TX_SEG_SIZE": "1M",
        "UCX_TCP_RX_SEG_SIZE": "1M",
        # Between workers on one host, every tagged message goes eager through the shared-
        # memory FIFO (copy-in, copy-out), never rendezvous. ucxx sets UCX_RNDV_THRESH=8192,
        # and between two processes UCX then moved every KV block over 8 KiB by "rendezvous
        # fragmented copy-in copy-out" through sysv (the same two copies, plus a handshake per
        # message); CMA, the one-copy path, is never selected for these endpoints (UCX 1.21,
        # UCX_PROTO_INFO=y), whatever UCX_TLS or UCX_CMA_BW say. Measured with `nori bench
        # transfer` (64 MiB, medians of 5; Intel Xeon, AVX-512, 2 cores shared with other
        # work, so the figures wander by +-30 %): 32 KiB blocks 0.95 -> 1.17 GB/s, 256 KiB
        # blocks 1.52 -> 2.06 GB/s, run back to back. Across hosts ucxx's 8 KiB stays.
        # (Larger FIFO segments, UCX_MM_SEG_SIZE=64k, made 32 KiB messages a little faster
        # again but broke transfers of 256 KiB messages: the receiver dropped the connection.)
        "UCX_RNDV_THRESH": "intra:inf,inter:8192",
        # No ucxx progress thread: `nori.transfer.ucx_progress.UcxProgress` drives the worker
        # from the asyncio loop (polling while data moves, sleeping on the worker's event fd
        # when idle). The thread (plus ucxx's notifier thread) cost half the bandwidth on few
        # cores, and ucxx's own blocking mode spins a core even when idle.
        "UCXPY_PROGRESS_MODE": "blocking",
        # ucxx sets UCX_MEMTYPE_CACHE, which UCX >= 1.19 no longer knows, so every process would
        # print an "unused environment variable" warning at start.
        "UCX_WARN_UNUSED_ENV_VARS": "n",
    }
)


def apply_ucx_env_defaults() -> None:
    for name, value in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


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
    external interfaces (its receiver opens none: senders reach it by its worker address). For such a worker only
    `lo` is used (UCX_NET_DEVICES; the shared-memory transports are not network devices, so
    KV between workers on one host still moves through shared memory). A default, as the
    others: an operator's UCX_NET_DEVICES wins. Call it before UCX starts (the first receiver
    or sender).
    """
    names = {name for _, name in socket.if_nameindex()}
    if is_loopback(host) and LOOPBACK_DEVICE in names:
        os.environ.setdefault("UCX_NET_DEVICES", LOOPBACK_DEVICE)
