"""`DecodeService.RenewLeases` calls from a prefill worker, over one cached channel per decode worker.

Decode workers come and go, so a channel nobody has used for a while is closed: the cache holds
the decode workers of the last few minutes, not every one ever seen.
"""

from __future__ import annotations

import time

import grpc

from nori.rpc.channels import ChannelCache
from nori.v1 import decode_pb2, decode_pb2_grpc

# A decode worker unused this long loses its channel (a later renewal opens a new one).
CHANNEL_IDLE_S = 300.0


class LeaseRenewalClient:
    def __init__(self, worker_id: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        """`metadata`: what every renewal carries, the cluster's token
        (`ClusterAuth.rpc_metadata()`)."""
        self._worker_id = worker_id
        self._metadata = metadata
        self._channels = ChannelCache()
        self._last_used: dict[str, float] = {}

    async def renew(
        self, address: str, renewals: list[tuple[str, bool]], timeout_s: float
    ) -> list[str]:
        """Renews the leases; returns the request ids the decode worker does not know."""
        await self._close_idle()
        stub = decode_pb2_grpc.DecodeServiceStub(self._channel(address))
        request = decode_pb2.RenewLeasesRequest(
            prefill_worker_id=self._worker_id,
            renewals=[
                decode_pb2.LeaseRenewal(request_id=request_id, started=started)
                for request_id, started in renewals
            ],
        )
        response: decode_pb2.RenewLeasesResponse = await stub.RenewLeases(
            request, timeout=timeout_s, metadata=self._metadata
        )
        return list(response.unknown_request_ids)

    def _channel(self, address: str) -> grpc.aio.Channel:
        self._last_used[address] = time.monotonic()
        return self._channels.get(address)

    async def _close_idle(self) -> None:
        now = time.monotonic()
        for address, used in list(self._last_used.items()):
            if now - used > CHANNEL_IDLE_S:
                del self._last_used[address]
                await self._channels.close(address)

    async def close(self) -> None:
        await self._channels.close_all()
        self._last_used.clear()
