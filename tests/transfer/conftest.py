"""A receiver process per transport, shared by a module's tests (spawning one costs ~2 s)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.transfer.helpers import KINDS
from tests.transfer.receiver_process import ReceiverProcess


@pytest.fixture(scope="module", params=KINDS)
def receiver(request: pytest.FixtureRequest) -> Iterator[ReceiverProcess]:
    process = ReceiverProcess.start(request.param)
    yield process
    process.stop()
