"""Choosing a transport, with and without ucxx, and the pieces the choice rests on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from nori.transfer.base import TransferRejected
from nori.transfer.factory import default_transport, make_receiver, make_sender, ucx_available
from nori.transfer.handoff import Address, TransferHeader, brief_address, parse_address, worker_peer
from nori.transfer.integrity import check_destinations, check_sources
from nori.transfer.tcp import TcpReceiver
from nori.transfer.ucx_env import LOOPBACK_DEVICE, confine_ucx_to, is_loopback
from tests.transfer.receiver_process import CacheSink

# Runs in a fresh interpreter where `import ucxx` fails, as on a machine without it.
_WITHOUT_UCXX = textwrap.dedent(
    """
    import asyncio, json, logging, sys
    sys.modules["ucxx"] = None  # any `import ucxx` now raises ImportError
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    import torch
    from nori.transfer.handoff import TransferHeader
    from nori.transfer.factory import default_transport, make_receiver, make_sender, ucx_available

    class Sink:
        def __init__(self):
            self.cache = torch.zeros(4, 16)
        def destinations(self, header):
            return [self.cache[i] for i in header.block_ids]
        def completed(self, header, nbytes):
            pass
        def failed(self, header, error):
            pass

    async def main():
        sink = Sink()
        receiver = make_receiver(None, sink)
        address = await receiver.start(host="127.0.0.1")
        sender = make_sender(None)
        data = torch.arange(16.0)
        await sender.send(address, TransferHeader.of("r", [2], [data.nbytes]), [data])
        try:
            await sender.send("ucx://127.0.0.1:1", TransferHeader.of("r", [2], [data.nbytes]), [data])
            ucx_address = "accepted"
        except ValueError as error:
            ucx_address = str(error)
        try:
            make_receiver("ucx", sink)
            explicit = "accepted"
        except ValueError as error:
            explicit = str(error)
        await sender.close()
        await receiver.close()
        print(json.dumps({
            "available": ucx_available(),
            "default": default_transport(),
            "receiver": type(receiver).__name__,
            "address": address,
            "landed": bool(torch.equal(sink.cache[2], data)),
            "ucx_address": ucx_address,
            "explicit_ucx": explicit,
        }))

    asyncio.run(main())
    """
)


def test_the_default_is_tcp_without_ucxx() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_UCXX], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["available"] is False and report["default"] == "tcp"
    assert report["receiver"] == "TcpReceiver"
    assert report["address"].startswith("tcp://127.0.0.1:")
    assert report["landed"]
    assert "no UCX transport" in report["ucx_address"]
    assert "ucxx" in report["explicit_ucx"] and "not importable" in report["explicit_ucx"]
    assert "ucxx is not importable" in result.stderr
    assert "using the TCP transport" in result.stderr


def test_kinds() -> None:
    sink = CacheSink({})
    assert isinstance(make_receiver("tcp", sink), TcpReceiver)
    with pytest.raises(ValueError, match="one of ucx, tcp, got 'auto'"):
        make_receiver("auto", sink)
    with pytest.raises(ValueError, match="one of"):
        make_sender("udp")
    # The default: UCX where ucxx imports, else TCP; no measurement.
    assert default_transport() == ("ucx" if ucx_available() else "tcp")
    if ucx_available():
        from nori.transfer.ucx import UcxReceiver

        assert isinstance(make_receiver(None, sink), UcxReceiver)
    else:
        assert isinstance(make_receiver(None, sink), TcpReceiver)


@pytest.mark.asyncio
async def test_a_tcp_sender_refuses_ucx_addresses() -> None:
    sender = make_sender("tcp")
    data = torch.zeros(4)
    with pytest.raises(ValueError, match="no UCX transport"):
        await sender.send("ucx://127.0.0.1:9", TransferHeader.of("r", [0], [16]), [data])
    await sender.close()


def test_addresses() -> None:
    assert parse_address("ucx://10.0.0.7:41234") == Address("ucx", "10.0.0.7", 41234)
    assert parse_address("tcp://[::1]:80") == Address("tcp", "::1", 80)
    assert str(Address("tcp", "::1", 80)) == "tcp://[::1]:80"
    for bad in ("10.0.0.7:1", "http://a:1", "tcp://a", "tcp://a:0", "tcp://a:x", "tcp://:5"):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_worker_addresses() -> None:
    """A loopback UCX receiver's address: its hello tag and UCX worker address, no port."""
    peer = worker_peer(0x0123456789ABCDEF, b"\x01\x02\xff")
    assert peer == "0123456789abcdef-0102ff"
    parsed = parse_address(f"ucx://127.0.0.1/{peer}")
    assert parsed == Address("ucx", "127.0.0.1", 0, peer)
    assert (parsed.hello_tag, parsed.worker_address) == (0x0123456789ABCDEF, b"\x01\x02\xff")
    assert str(parsed) == f"ucx://127.0.0.1/{peer}"
    assert parsed.brief == "ucx://127.0.0.1/0123456789abcdef"
    assert brief_address("tcp://[::1]:80") == "tcp://[::1]:80"
    assert brief_address("not an address") == "not an address"
    for bad in (
        "ucx://127.0.0.1/xyz",
        "ucx://127.0.0.1/0123-0102",  # a short tag
        "ucx://127.0.0.1/0123456789abcdef-010",  # half a byte
        "ucx://127.0.0.1/0123456789abcdef-",
        "ucx://127.0.0.1/0123456789abcdeg-0102",
        "ucx:///0123456789abcdef-0102",
        "tcp://127.0.0.1/0123456789abcdef-0102",
        f"ucx://h/0123456789abcdef-{'ab' * 5000}",
    ):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_header_validation() -> None:
    header = TransferHeader.of("r", [1, 2], [8, 8], generator_state=b"\x00\x01")
    assert TransferHeader.from_bytes(header.to_bytes()) == header
    valid = header.to_bytes()
    for bad, complaint in (
        (b"{", "not a Nori"),
        (b"null", "not a Nori"),
        (b'{"version": 1}', "not a Nori"),
        (b"NKV", "not a Nori"),
        (valid[:3] + b"\x01" + valid[4:], "version 1 is not supported"),
        (valid[:4] + b"\x0a\x05", "malformed"),
        (TransferHeader.of("", [1], [8]).to_bytes(), "request_id"),
        (TransferHeader.of("r", [1], [-8]).to_bytes(), "negative sizes"),
    ):
        with pytest.raises(ValueError, match=complaint):
            TransferHeader.from_bytes(bad)


def test_buffer_checks() -> None:
    header = TransferHeader.of("r", [0], [32])
    bf16 = torch.zeros(2, 8, dtype=torch.bfloat16)
    (view,) = check_sources(header, [bf16])
    assert view.dtype == torch.uint8 and view.numel() == 32
    assert view.data_ptr() == bf16.data_ptr()  # a view, not a copy
    with pytest.raises(ValueError, match="contiguous"):
        check_sources(header, [torch.zeros(8, 4, dtype=torch.bfloat16).t()])
    with pytest.raises(ValueError, match="holds 16 bytes"):
        check_sources(header, [torch.zeros(4)])
    with pytest.raises(ValueError, match="2 buffers"):
        check_sources(header, [bf16, bf16])
    with pytest.raises(TransferRejected, match="size mismatch"):
        check_destinations(header, [torch.zeros(4)])
    with pytest.raises(TransferRejected, match="not a contiguous tensor"):
        check_destinations(header, [torch.zeros(2, 4).t()])


def test_a_loopback_worker_keeps_ucx_on_the_loopback_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`nori up`'s workers (--host 127.0.0.1): UCX's own TCP sockets on `lo` only; a worker on
    another address, or an operator's own UCX_NET_DEVICES, is left alone."""
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    confine_ucx_to("0.0.0.0")
    confine_ucx_to("10.1.2.3")
    confine_ucx_to("decode-0.internal")
    assert "UCX_NET_DEVICES" not in os.environ
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert is_loopback(host)
        monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
        confine_ucx_to(host)
        assert os.environ["UCX_NET_DEVICES"] == LOOPBACK_DEVICE
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1")
    confine_ucx_to("127.0.0.1")
    assert os.environ["UCX_NET_DEVICES"] == "mlx5_0:1"


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
async def test_a_tcp_receiver_listens_on_its_host_only(host: str) -> None:
    receiver = TcpReceiver(CacheSink({}))
    try:
        await receiver.start(host=host, port=0)
    except OSError as error:
        pytest.skip(f"no {host} here: {error}")
    try:
        listener = receiver._listener
        assert listener is not None and listener.getsockname()[0] == host
    finally:
        await receiver.close()
