"""Which KV layout (block size, cache dtype) the cluster runs with, and which workers it leaves
out (pure logic)."""

from __future__ import annotations

import contextlib

from nori.gateway.worker_pool import WorkerPool, agree_on_kv_layout
from nori.state.registry import WorkerInfo, WorkerListing


def worker(
    worker_id: str, block_size: int, started_at: float, kv_cache_dtype: str = ""
) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role="decode",
        block_size=block_size,
        started_at=started_at,
        kv_cache_dtype=kv_cache_dtype,
    )


def ids(workers: list[WorkerInfo]) -> list[str]:
    return [w.worker_id for w in workers]


def test_the_longest_running_worker_sets_the_block_size() -> None:
    workers = [worker("late", 32, 200.0), worker("first", 16, 100.0), worker("second", 16, 150.0)]
    agreement = agree_on_kv_layout(workers, expected=None)
    assert agreement.block_size == 16
    assert ids(agreement.members) == ["first", "second"]
    assert ids(agreement.refused) == ["late"]


def test_an_explicit_block_size_wins() -> None:
    workers = [worker("first", 16, 100.0), worker("late", 32, 200.0)]
    agreement = agree_on_kv_layout(workers, expected=32)
    assert agreement.block_size == 32
    assert ids(agreement.members) == ["late"] and ids(agreement.refused) == ["first"]


def test_workers_that_state_no_size_are_kept_and_none_is_known_without_one() -> None:
    silent = worker("old-version", 0, 50.0)
    assert agree_on_kv_layout([silent], expected=None).block_size is None
    agreement = agree_on_kv_layout([silent, worker("new", 16, 100.0)], expected=None)
    assert agreement.block_size == 16
    assert ids(agreement.members) == ["old-version", "new"] and agreement.refused == []
    assert agree_on_kv_layout([], expected=None).block_size is None


def test_workers_whose_kv_cache_dtype_differs_from_the_clusters_are_left_out() -> None:
    """KV blocks move as stored: an fp8 decode worker cannot take a float32 prefill's blocks."""
    workers = [
        worker("late-fp8", 16, 300.0, "float8_e4m3fn"),
        worker("first", 16, 100.0, "float32"),
        worker("old-version", 16, 50.0),
        worker("second", 16, 200.0, "float32"),
    ]
    agreement = agree_on_kv_layout(workers, expected=None)
    assert agreement.kv_cache_dtype == "float32" and agreement.block_size == 16
    assert ids(agreement.members) == ["first", "old-version", "second"]
    assert ids(agreement.refused) == ["late-fp8"]
    # A worker wrong on both counts is refused once.
    both = worker("both", 32, 400.0, "int8")
    assert ids(agree_on_kv_layout([*workers, both], expected=None).refused) == ["late-fp8", "both"]


def test_a_failure_mark_steers_requests_away_but_never_leaves_none() -> None:
    from nori.gateway.worker_pool import WorkerPool

    pool = WorkerPool(registry=None, block_size=16)  # type: ignore[arg-type]
    pool.workers = [
        WorkerInfo(worker_id="p0", role="prefill"),
        WorkerInfo(worker_id="p1", role="prefill"),
        WorkerInfo(worker_id="d0", role="decode"),
    ]
    pool.mark_failed("p0")
    assert ids(pool.available("prefill")) == ["p1"]
    pool.mark_failed("p1")  # every prefill worker marked: the marks are only a hint
    assert ids(pool.available("prefill")) == ["p0", "p1"]
    pool.mark_failed("d0")
    assert "d0" in ids(pool.routable())
    pool.mark_failed("p0", for_s=-1.0)  # an expired mark
    assert ids(pool.available("prefill")) == ["p0"]


class ListedRegistry:
    """A registry that answers whatever the test lists, or fails like a Redis that is away."""

    def __init__(self) -> None:
        self.listing: list[WorkerInfo] | None = []

    async def list_entries(self) -> WorkerListing:
        if self.listing is None:
            raise ConnectionError("Redis is away")
        return WorkerListing(list(self.listing))


async def refreshed(
    pool: WorkerPool, registry: ListedRegistry, listing: list[WorkerInfo] | None
) -> list[str]:
    registry.listing = listing
    with contextlib.suppress(ConnectionError):
        await pool.refresh()
    return ids(pool.workers)


async def test_workers_outlive_a_redis_that_comes_back_empty_until_they_re_register() -> None:
    registry = ListedRegistry()
    pool = WorkerPool(registry, block_size=16)  # type: ignore[arg-type]
    p0, d0, d1 = (WorkerInfo(worker_id=n, role=r) for n, r in (("p0", "prefill"),
                  ("d0", "decode"), ("d1", "decode")))  # fmt: skip
    assert await refreshed(pool, registry, [d0, d1, p0]) == ["d0", "d1", "p0"]
    # Redis is away: the last list stands.
    assert await refreshed(pool, registry, None) == ["d0", "d1", "p0"]
    # It comes back empty; the workers, still serving, re-register one by one.
    assert await refreshed(pool, registry, [d1]) == ["d0", "d1", "p0"]
    assert await refreshed(pool, registry, [d1, p0]) == ["d0", "d1", "p0"]
    # d0 never comes back: it drops out once the grace is over.
    pool._kept_until = 0.0
    assert await refreshed(pool, registry, [d1, p0]) == ["d1", "p0"]


async def test_without_an_outage_a_worker_missing_from_the_registry_has_left() -> None:
    registry = ListedRegistry()
    pool = WorkerPool(registry, block_size=16)  # type: ignore[arg-type]
    d0, d1 = WorkerInfo(worker_id="d0", role="decode"), WorkerInfo(worker_id="d1", role="decode")
    assert await refreshed(pool, registry, [d0, d1]) == ["d0", "d1"]
    assert await refreshed(pool, registry, []) == []
    # A worker that was draining when Redis went away left on purpose: not kept.
    draining = WorkerInfo(worker_id="d0", role="decode", draining=True)
    assert await refreshed(pool, registry, [draining, d1]) == ["d0", "d1"]
    assert await refreshed(pool, registry, None) == ["d0", "d1"]
    assert await refreshed(pool, registry, [d1]) == ["d1"]
