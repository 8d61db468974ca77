"""A receiver process per transport, shared by a module's tests (spawning one costs ~2 s)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.transfer.helpers import KINDS, PULL_KINDS
from tests.transfer.receiver_process import ReceiverProcess


@pytest.fixture(scope="module", params=[*KINDS, *PULL_KINDS])
def receiver(request: pytest.FixtureRequest) -> Iterator[ReceiverProcess]:
    """A receiver taking the bytes as messages ("tcp", "ucx"), or copying them out of the
    sender's shared memory ("tcp+pull", "ucx+pull")."""
    kind, _, pull = request.param.partition("+")
    process = ReceiverProcess.start(kind, "pull" if pull else "messages")
    yield process
    process.stop()
