"""The router's count of prompts on a prefill worker is released on every path, even when the
request fails between the pick and the first worker call (issue 22: a value the proto cannot
carry, raised after the slot was taken, left the count held forever and skewed routing)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from nori.gateway.backend import GenerationRequest
from nori.gateway.ledger import Ledger
from nori.gateway.request_flow import RequestFlow
from nori.sampling.params import SamplingParams
from nori.state.registry import WorkerInfo

PREFILL = WorkerInfo("prefill-0", "prefill", grpc_address="127.0.0.1:9")
DECODE = WorkerInfo("decode-0", "decode", grpc_address="127.0.0.1:9")


class OnePrefillPool:
    """What RequestFlow asks of the worker pool, for one prefill worker (never called)."""

    block_size = 16

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel

    def available(self, role: str) -> list[WorkerInfo]:
        return [PREFILL] if role == "prefill" else []

    def channel(self, address: str) -> grpc.aio.Channel:
        return self._channel


class NoCachedPrefixes:
    async def longest_prefixes(self, hashes: Any, worker_ids: Any) -> dict[str, int]:
        return {}


@pytest.mark.asyncio
async def test_a_failure_after_the_prefill_pick_releases_the_slot() -> None:
    # Lazy: nothing connects unless a call is made, and none is.
    channel = grpc.aio.insecure_channel("127.0.0.1:9")
    ledger = Ledger()
    flow = RequestFlow(OnePrefillPool(channel), ledger, NoCachedPrefixes(), None)  # type: ignore[arg-type]
    # SamplingParams takes any int; the proto's int32 top_k does not (the gateway refuses it
    # with a 400 first, protocol.Int32: this is the path if anything else ever fails there).
    request = GenerationRequest("r-1", [1, 2, 3], SamplingParams(max_tokens=4, top_k=2**31))
    ticket = ledger.admit(request, 1, 0.0)
    with pytest.raises(ValueError, match="out of range"):
        async for _ in flow.serve_disaggregated(request, DECODE, ticket):
            pass
    assert ledger.pending_prompt_tokens == {}
    assert ledger.in_flight == {}
    await channel.close()
