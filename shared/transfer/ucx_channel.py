"""One UCX connection: the transport's send and receive of messages and of KV buffers.

`UcxChannel` wraps a listener's endpoint pair, or two one-way endpoints between worker addresses
whose ends say bye when they close. The sender posts every buffer at once; the receiver lands
each run in the sink's tensor, or a `ScatteredRun` through a staging buffer. ucxx failures
become TransferError.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

import numpy as np
import torch

from nori.transfer.base import TransferError
from nori.transfer.buffers import MAX_RUN_BYTES, ReceivePiece, ScatteredRun, scatter_copy
from nori.transfer.conversation import ConnectionClosed, MessageTooLarge
from nori.transfer.integrity import TransferHasher, hash_chunks
from nori.transfer.ucx_progress import Poster, UcxProgress, UcxRequest, abort
from nori.transfer.ucx_worker_address import ConnectionTags, PeerWatch

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Requests posted between two rounds of progress, so data moves while the rest is posted.
_POST_BATCH = 64
# Staging buffers a receiving connection fills at once, keeping the sender streaming.
_STAGING_SLOTS = 4


def _ucx_buffer(view: torch.Tensor) -> object:
    """A flat uint8 view as ucxx takes it, without a copy: a NumPy array, or the CUDA tensor."""
    return view if view.is_cuda else view.numpy()


class UcxChannel:
    """One connection: a listener's endpoint pair, or (with `tags`) two one-way endpoints."""

    def __init__(
        self,
        endpoint: Any,
        progress: UcxProgress,
        tags: ConnectionTags | None = None,
        peer: PeerWatch | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._progress = progress
        self._poster = Poster(endpoint)
        self._tags = tags
        self._peer = peer
        self._closed = False
        self._free_slots: list[np.ndarray] = []

    @property
    def alive(self) -> bool:
        return not self._closed and not self._endpoint.closed and not self._peer_said_bye()

    async def _transport(self, operation: Awaitable[T], what: str) -> T:
        """Runs a ucxx operation; its failures become TransferError."""
        if self._closed:
            raise TransferError("the connection is closed")
        try:
            return await operation
        except (TransferError, asyncio.CancelledError):
            raise
        except Exception as error:
            raise TransferError(f"UCX {what} failed: {error or type(error).__name__}") from error

    async def send_message(self, payload: bytes) -> None:
        message = np.frombuffer(payload, dtype=np.uint8)
        if self._tags is None:
            await self._transport(self._progress.run(self._endpoint.send(message)), "send")
        else:
            # A message the peer never takes (it left) must not wait for ever.
            sent = self._progress.wait_all([self._poster.send(message)], self._peer)
            await self._transport(sent, "send")

    async def recv_message(self, max_bytes: int) -> bytes:
        length = await self._transport(
            self._progress.wait_message(self._endpoint, self._peer), "receive"
        )
        if length is None:
            raise ConnectionClosed("the peer closed the connection")
        if length > max_bytes:
            raise MessageTooLarge(f"a message of {length} bytes exceeds the {max_bytes}-byte limit")
        message = np.empty(length, dtype=np.uint8)
        # The public recv: it still finds a message that arrived just before the peer left.
        await self._transport(self._progress.run(self._endpoint.recv(message)), "receive")
        return message.tobytes()

    def _peer_said_bye(self) -> bool:
        return self._peer is not None and self._peer()

    async def _send_all(self, views: list[torch.Tensor], hasher: TransferHasher | None) -> None:
        """Posts a send of every view, feeding `hasher` every byte in order; on the host each
        hash chunk is hashed right before it is posted, so UCX's copy finds it in cache."""
        on_host = not any(view.is_cuda for view in views)
        chunk_ends: dict[int, memoryview] = (
            dict(hash_chunks(views)) if hasher is not None and on_host else {}
        )
        requests: list[UcxRequest] = []
        pending: list[int] = []
        for index, view in enumerate(views):
            if view.numel():
                pending.append(index)
            if index in chunk_ends or len(pending) >= _POST_BATCH or index == len(views) - 1:
                if index in chunk_ends:
                    hasher.update(chunk_ends[index])  # type: ignore[union-attr]
                requests.extend(self._poster.send(_ucx_buffer(views[i])) for i in pending)
                pending = []
                self._progress.poll()
        # Two one-way endpoints: a peer that leaves mid-transfer says so only with its bye.
        await self._progress.wait_all(requests, self._peer)
        if hasher is not None and not on_host:
            for view in views:  # CUDA: from host copies, after the transfer
                hasher.update(view.cpu().numpy().data)

    def _staging_slot(self) -> np.ndarray:
        """A free staging buffer of MAX_RUN_BYTES, kept for later transfers."""
        if self._free_slots:
            return self._free_slots.pop()
        return np.empty(MAX_RUN_BYTES, dtype=np.uint8)

    async def _receive_all(self, pieces: list[ReceivePiece], hasher: TransferHasher | None) -> None:
        """Posts a receive per piece, in order: in place, or for a `ScatteredRun` into a staging
        buffer copied to its places (then reused) as soon as it lands. Each piece is hashed
        the moment it lands, in order, while it is still in cache."""
        on_host = not any(piece.is_cuda for piece in pieces if not isinstance(piece, ScatteredRun))
        inflight: collections.deque[tuple[UcxRequest, ReceivePiece, np.ndarray | None]] = (
            collections.deque()
        )
        staged_inflight = 0

        def land() -> None:
            nonlocal staged_inflight
            request, piece, slot = inflight.popleft()
            request.result()
            if slot is None:
                if hasher is not None and on_host:
                    hasher.update(_ucx_buffer(piece))  # type: ignore[arg-type]
                return
            assert isinstance(piece, ScatteredRun)
            landed = slot[: piece.nbytes]
            if hasher is not None:
                hasher.update(landed.data)
            scatter_copy(landed, piece.views)
            self._free_slots.append(slot)
            staged_inflight -= 1

        try:
            posted = 0
            for piece in pieces:
                if isinstance(piece, ScatteredRun):
                    if not piece.nbytes:
                        continue
                    while staged_inflight >= _STAGING_SLOTS:
                        await self._progress.wait_all([inflight[0][0]], self._peer)
                        land()
                    slot = self._staging_slot()
                    staged_inflight += 1
                    inflight.append((self._poster.recv(slot[: piece.nbytes]), piece, slot))
                elif piece.numel():
                    inflight.append((self._poster.recv(_ucx_buffer(piece)), piece, None))
                else:
                    continue
                posted += 1
                if posted % _POST_BATCH == 0:
                    self._progress.poll()
                    while inflight and inflight[0][0].done():
                        land()
            while inflight:
                await self._progress.wait_all([inflight[0][0]], self._peer)
                land()
        except BaseException:
            # Receives still posted write into their buffers until the endpoint is aborted.
            self._progress.keep([request for request, _, _ in inflight])
            raise
        if hasher is not None and not on_host:
            for piece in pieces:  # CUDA: from host copies, after the transfer
                assert not isinstance(piece, ScatteredRun)
                hasher.update(piece.cpu().numpy().data)

    async def send_buffers(
        self, views: list[torch.Tensor], hasher: TransferHasher | None = None
    ) -> None:
        await self._transport(self._send_all(views, hasher), "send")

    async def recv_buffers(
        self, pieces: list[ReceivePiece], hasher: TransferHasher | None = None
    ) -> None:
        await self._transport(self._receive_all(pieces, hasher), "receive")

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                if self._tags is not None and not self._peer_said_bye():
                    self._progress.say_bye(self._endpoint, self._tags.send_bye)
                abort(self._endpoint)
            except Exception as error:
                logger.debug("UCX endpoint abort failed: %s", error)
            self._progress.wake()
