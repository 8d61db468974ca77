"""Repeated failures are logged once with a count."""

from __future__ import annotations

import logging

import pytest

from nori.repeated_log import RepeatedFailureLog


def test_a_burst_of_failures_is_one_line_then_a_count(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr("nori.repeated_log.time.monotonic", lambda: clock[0])
    log = RepeatedFailureLog(logging.getLogger("test.repeated"), "writing to Redis", 10.0)
    with caplog.at_level(logging.WARNING, logger="test.repeated"):
        for _ in range(1000):
            log.failed(ConnectionError("refused"))
        clock[0] += 11
        log.failed(ConnectionError("still refused"))
    messages = [record.getMessage() for record in caplog.records]
    assert messages == [
        "writing to Redis failed: refused",
        "writing to Redis failed 999 more times in the last 11 s; now: still refused",
    ]
    assert caplog.records[0].exc_info is not None and caplog.records[1].exc_info is None
    assert log.total == 1001
