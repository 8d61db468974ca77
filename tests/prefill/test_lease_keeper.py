"""The prefill side's renewals: one call per decode worker per round, only while it holds prompts
and its engine works, and never again for a request the decode worker has let go."""

from __future__ import annotations

import asyncio
import contextlib

from nori.prefill.servicer import LeaseKeeper


class FakeDecodes:
    def __init__(self, unknown: set[str] | None = None) -> None:
        self.calls: list[tuple[str, list[tuple[str, bool]], float]] = []
        self.unknown = unknown or set()
        self.down: set[str] = set()

    async def renew(self, address: str, batch: list[tuple[str, bool]], timeout: float) -> list[str]:
        self.calls.append((address, list(batch), timeout))
        if address in self.down:
            raise ConnectionError("unreachable")
        return [request_id for request_id, _ in batch if request_id in self.unknown]


async def test_one_batched_renewal_per_decode_worker_with_the_started_flags() -> None:
    decodes = FakeDecodes()
    keeper = LeaseKeeper(decodes.renew, lambda: True)
    keeper.hold("a", "d0:1", lease_s=3.0)
    keeper.hold("b", "d1:1", lease_s=1.5)
    keeper.hold("c", "d0:1", lease_s=3.0)
    keeper.hold("old-gateway", "", lease_s=3.0)  # no renewal address: not kept
    keeper.started({"c", "not-held"})
    assert keeper.period_s() == 0.5  # a third of the shortest lease held
    await keeper.renew_once()
    assert sorted(decodes.calls) == [
        ("d0:1", [("a", False), ("c", True)], 0.5),
        ("d1:1", [("b", False)], 0.5),
    ]
    keeper.release("b")
    decodes.calls.clear()
    await keeper.renew_once()
    assert decodes.calls == [("d0:1", [("a", False), ("c", True)], 1.0)]


async def test_unknown_requests_are_dropped_and_failures_retried() -> None:
    decodes = FakeDecodes(unknown={"a"})
    keeper = LeaseKeeper(decodes.renew, lambda: True)
    keeper.hold("a", "d0:1", lease_s=3.0)
    keeper.hold("b", "d1:1", lease_s=3.0)
    decodes.down.add("d1:1")
    await keeper.renew_once()
    assert keeper.num_held == 1  # "a" expired or finished there; "b" is tried again
    decodes.calls.clear()
    await keeper.renew_once()
    assert decodes.calls == [("d1:1", [("b", False)], 1.0)]


async def test_a_stalled_engine_stops_the_renewals() -> None:
    decodes = FakeDecodes()
    responsive = True
    keeper = LeaseKeeper(decodes.renew, lambda: responsive)
    keeper.hold("a", "d0:1", lease_s=3.0)
    responsive = False
    await keeper.renew_once()
    assert decodes.calls == []
    responsive = True
    await keeper.renew_once()
    assert len(decodes.calls) == 1


async def test_the_loop_renews_at_once_when_a_prompt_arrives_then_every_period() -> None:
    decodes = FakeDecodes()
    keeper = LeaseKeeper(decodes.renew, lambda: True)
    task = asyncio.ensure_future(keeper.run())
    try:
        await asyncio.sleep(0.05)
        assert decodes.calls == []  # nothing held: idle, no calls
        keeper.hold("a", "d0:1", lease_s=0.3)
        await asyncio.sleep(0.01)
        assert len(decodes.calls) == 1
        await asyncio.sleep(0.35)
        assert 2 <= len(decodes.calls) <= 5  # every 0.1 s (fewer when this machine is busy)
        keeper.release("a")
        await asyncio.sleep(0.2)
        count = len(decodes.calls)
        await asyncio.sleep(0.2)
        assert len(decodes.calls) == count
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
