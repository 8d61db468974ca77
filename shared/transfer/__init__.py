"""Transports that move KV blocks between workers: UCX (ucxx) and a plain TCP fallback.

A decode worker implements `KVSink` and runs `make_receiver(None, sink)` (UCX where ucxx
imports, TCP otherwise); a prefill worker sends with `make_sender(None)` (by address scheme).
Importing this package does not import ucxx; `make_*(None|"ucx")` and `ucx_available()` do."""

from nori.transfer.base import (
    KVReceiver,
    KVSender,
    KVSink,
    TransferConfig,
    TransferError,
    TransferRejected,
)
from nori.transfer.factory import default_transport, make_receiver, make_sender, ucx_available
from nori.transfer.handoff import TransferHeader

__all__ = [
    "KVReceiver",
    "KVSender",
    "KVSink",
    "TransferConfig",
    "TransferError",
    "TransferHeader",
    "TransferRejected",
    "default_transport",
    "make_receiver",
    "make_sender",
    "ucx_available",
]
