"""Choosing a transport: "ucx" where ucxx imports, else "tcp"; a caller may name either. Only the
receiver's choice matters: its address scheme tells senders which transport to use."""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

import torch

from nori.transfer.base import (
    KVReceiver,
    KVSender,
    KVSink,
    TransferConfig,
    TransferError,
    TransferHeader,
)
from nori.transfer.handoff import parse_address
from nori.transfer.tcp import TcpReceiver, TcpSender

logger = logging.getLogger(__name__)

KINDS = ("ucx", "tcp")


def _load_ucx() -> ModuleType | str:
    try:
        return importlib.import_module("nori.transfer.ucx")
    except (ImportError, OSError) as error:
        return str(error) or type(error).__name__


def ucx_available() -> bool:
    return isinstance(_load_ucx(), ModuleType)


def default_transport() -> str:
    """ "ucx" where ucxx imports, else "tcp" (saying why once per process)."""
    module = _load_ucx()
    if isinstance(module, str):
        _warn_no_ucxx(module)
        return "tcp"
    return "ucx"


@functools.cache
def _warn_no_ucxx(reason: str) -> None:
    logger.warning("ucxx is not importable (%s); using the TCP transport", reason)


def _ucx_module(kind: str | None) -> ModuleType | None:
    """The UCX transport's module for "ucx" (None: `default_transport()`); None for "tcp"."""
    kind = default_transport() if kind is None else kind
    if kind not in KINDS:
        raise ValueError(f"transport kind must be one of {', '.join(KINDS)}, got {kind!r}")
    module = _load_ucx() if kind == "ucx" else None
    if isinstance(module, str):
        raise ValueError(
            f"the UCX transport needs ucxx, which is not importable ({module}); "
            "install ucxx-cu12 or choose the tcp transport"
        )
    return module


def make_receiver(
    kind: str | None, sink: KVSink, config: TransferConfig | None = None
) -> KVReceiver:
    """A receiver of `kind` ("ucx" or "tcp"; None: `default_transport()`)."""
    ucx = _ucx_module(kind)
    receiver: KVReceiver = (
        TcpReceiver(sink, config) if ucx is None else ucx.UcxReceiver(sink, config)
    )
    return receiver


def make_sender(kind: str | None, config: TransferConfig | None = None) -> KVSender:
    """A sender for either address scheme; with "tcp" (None without ucxx) ucxx is never loaded
    and a ucx:// address raises ValueError."""
    return MultiSender(_ucx_module(kind), config)


class MultiSender:
    """Dispatches each transfer by the address scheme, creating each transport's sender lazily."""

    def __init__(self, ucx_module: ModuleType | None, config: TransferConfig | None = None) -> None:
        self._ucx_module = ucx_module
        self._config = config
        self._senders: dict[str, KVSender] = {}
        self._closed = False

    def _sender(self, scheme: str) -> KVSender:
        if self._closed:
            raise TransferError("the sender is closed")
        sender = self._senders.get(scheme)
        if sender is None:
            if scheme == "tcp":
                sender = TcpSender(self._config)
            elif self._ucx_module is not None:
                sender = self._ucx_module.UcxSender(self._config)
            else:
                raise ValueError(
                    "cannot send to a ucx:// address: this sender has no UCX transport"
                )
            self._senders[scheme] = sender
        return sender

    @property
    def bytes_sent(self) -> int:
        return sum(sender.bytes_sent for sender in self._senders.values())

    async def send(self, address: str, header: TransferHeader, buffers: list[torch.Tensor]) -> None:
        await self._sender(parse_address(address).scheme).send(address, header, buffers)

    async def close(self) -> None:
        self._closed = True
        for sender in list(self._senders.values()):
            await sender.close()
