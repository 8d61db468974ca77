"""Test-session setup that must happen before any test module imports triton or nori.

Without a GPU, Triton kernels run in Triton's CPU interpreter, which triton reads from
TRITON_INTERPRET when a function is decorated: set it before anything is imported.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real Redis: REDIS_URL when reachable, else a private redis-server on a free port."""
    from nori.launch.redis_server import RedisUnavailable, resolve_redis_url

    try:
        url, server = resolve_redis_url(os.environ.get("REDIS_URL") or None)
    except RedisUnavailable as error:
        pytest.skip(f"no Redis for this test: {error}")
    try:
        yield url
    finally:
        if server is not None:
            server.stop()


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built() -> None:
    """Builds the C++ CPU kernels once, in this process, before any test starts workers, which
    then load them rather than each building its own copy. Built already, this only loads them."""
    from nori.kernels.cpu_build import cpu_kernels

    cpu_kernels()
