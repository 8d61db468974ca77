"""The gateway app's shutdown is bounded: request tasks that ignore their cancel and a backend
whose close hangs are waited on SHUTDOWN_WAIT_S each, then logged, never waited on for ever."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from nori.gateway import app as app_module


class _StuckBackend:
    async def close(self) -> None:
        await asyncio.sleep(3600)


class _Backend:
    closed = False

    async def close(self) -> None:
        self.closed = True


async def _ignores_cancel(release: asyncio.Event) -> None:
    while not release.is_set():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            continue


async def _ends_on_cancel(ended: list[bool]) -> None:
    try:
        await asyncio.sleep(3600)
    finally:
        ended.append(True)


def test_a_stuck_task_and_backend_are_logged_not_waited_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(app_module, "SHUTDOWN_WAIT_S", 0.2)

    async def scenario() -> float:
        release = asyncio.Event()
        stuck = asyncio.ensure_future(_ignores_cancel(release))
        await asyncio.sleep(0)
        started = time.monotonic()
        await app_module._shutdown({stuck}, _StuckBackend())  # type: ignore[arg-type]
        elapsed = time.monotonic() - started
        release.set()
        stuck.cancel()
        await asyncio.gather(stuck, return_exceptions=True)
        return elapsed

    with caplog.at_level(logging.WARNING, logger="nori.gateway"):
        elapsed = asyncio.run(scenario())
    assert elapsed < 2.0
    messages = [record.getMessage() for record in caplog.records]
    assert any("1 request task(s) still running" in m and "test_shutdown.py" in m for m in messages)
    assert any("backend did not close" in m for m in messages)


def test_tasks_that_end_on_cancel_are_awaited_and_the_backend_closed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ended: list[bool] = []
    backend = _Backend()

    async def scenario() -> None:
        tasks = {asyncio.ensure_future(_ends_on_cancel(ended)) for _ in range(3)}
        await asyncio.sleep(0)
        await app_module._shutdown(tasks, backend)  # type: ignore[arg-type]

    with caplog.at_level(logging.WARNING, logger="nori.gateway"):
        asyncio.run(scenario())
    assert ended == [True, True, True] and backend.closed
    assert not caplog.records
