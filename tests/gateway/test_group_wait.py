"""GroupWait: a batch member's backoff while every worker is full, and its time limit."""

from __future__ import annotations

import asyncio

import pytest

from nori.gateway.cluster import MAX_DELAY_S, GroupWait


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_single_request_never_waits() -> None:
    assert asyncio.run(GroupWait(0.0).turn()) is False


def test_turns_back_off_and_stop_at_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    wait = GroupWait(3.0, clock)

    async def turns() -> list[bool]:
        return [await wait.turn() for _ in range(8)]

    results = asyncio.run(turns())
    # 0.05 + 0.1 + 0.2 + 0.4 + 0.8 + 1.0 = 2.55 s, then the 0.45 s left, then no more.
    assert results == [True] * 7 + [False]
    assert slept == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, MAX_DELAY_S, 0.45])
