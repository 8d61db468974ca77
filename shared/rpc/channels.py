"""One gRPC channel per peer address, opened on first use and kept until closed."""

from __future__ import annotations

import grpc

from nori.rpc.options import GRPC_OPTIONS


class ChannelCache:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
            self._channels[address] = channel
        return channel

    def addresses(self) -> list[str]:
        return list(self._channels)

    async def close(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close_all(self) -> None:
        channels = list(self._channels.values())
        self._channels.clear()
        for channel in channels:
            await channel.close()
