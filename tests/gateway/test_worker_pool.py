"""Which KV layout (block size, cache dtype) and speculative decoding the cluster runs with, and
which workers it leaves out (pure logic)."""

from __future__ import annotations

import contextlib
import logging

import pytest

from nori.gateway.worker_agreement import agree_on_kv_layout, agree_on_speculation
from nori.gateway.worker_pool import PROMPT_SLOTS_SHARED_PER_WORKER, PoolCapacity, WorkerPool
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


NGRAM = '{"method": "ngram", "num_speculative_tokens": 3}'
NGRAM_4 = '{"method": "ngram", "num_speculative_tokens": 4}'


def speculating(
    worker_id: str, started_at: float, speculative_config: str, role: str = "decode"
) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        started_at=started_at,
        speculative_config=speculative_config,
    )


def test_the_longest_running_worker_sets_the_speculative_decoding() -> None:
    workers = [
        speculating("late-4", 300.0, NGRAM_4),
        speculating("prefill", 100.0, NGRAM, role="prefill"),
        speculating("decode", 200.0, NGRAM),
        speculating("late-off", 400.0, ""),
    ]
    agreement = agree_on_speculation(workers)
    assert agreement.speculative_config == NGRAM
    assert ids(agreement.members) == ["prefill", "decode"]
    assert ids(agreement.refused) == ["late-4", "late-off"]
    assert agree_on_speculation([]).speculative_config is None


def test_an_entry_without_speculation_is_off_not_silent() -> None:
    """Unlike an unstated dtype, a missing speculative_config (a version before it) means off:
    such a worker does not pair with one that speculates, whichever started first."""
    old_version = WorkerInfo.from_mapping(
        {"worker_id": "old", "role": "prefill", "started_at": "1"}
    )
    assert old_version.speculative_config == ""
    agreement = agree_on_speculation([speculating("new", 2.0, NGRAM), old_version])
    assert agreement.speculative_config == ""
    assert ids(agreement.members) == ["old"] and ids(agreement.refused) == ["new"]
    assert agree_on_speculation([speculating("a", 2.0, ""), old_version]).refused == []


async def test_a_worker_that_speculates_otherwise_is_refused_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = ListedRegistry()
    pool = WorkerPool(registry, block_size=16)  # type: ignore[arg-type]
    first, second = speculating("d0", 1.0, NGRAM), speculating("p0", 2.0, NGRAM, role="prefill")
    odd = speculating("d1", 3.0, "")
    with caplog.at_level(logging.ERROR, logger="nori.gateway.worker_pool"):
        for _ in range(3):  # the pool rereads the registry twice a second: still one line
            assert await refreshed(pool, registry, [first, second, odd]) == ["d0", "p0"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        "refusing worker d1: its speculative decoding is off, the cluster's is "
        f"{NGRAM} (every worker must run with the same --speculative-config)"
    )
    # A worker refused for its KV layout is not what sets the cluster's speculation.
    caplog.clear()
    wrong_layout = WorkerInfo(worker_id="d9", role="decode", block_size=32, started_at=0.5)
    assert await refreshed(pool, registry, [wrong_layout, first, second]) == ["d0", "p0"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("refusing worker d9: its KV blocks are 32 tokens")


async def test_the_pools_capacities_are_the_registry_entries_figures() -> None:
    """Known from the first read of the registry (no wait for a stats poll); an entry without
    figures (an older writer) counts as the others' mean; a draining worker not at all."""
    registry = ListedRegistry()
    pool = WorkerPool(registry, block_size=16)  # type: ignore[arg-type]
    entries = [
        WorkerInfo(worker_id="p0", role="prefill", max_num_seqs=32, max_open_calls=40),
        WorkerInfo(worker_id="d0", role="decode", max_num_seqs=64, max_open_calls=80),
        WorkerInfo(worker_id="d1", role="decode"),
        WorkerInfo(worker_id="d2", role="decode", max_num_seqs=8, max_open_calls=9, draining=True),
    ]
    await refreshed(pool, registry, entries)
    decode, prompt = pool.capacities(prompts_on_decode=False)
    assert decode == PoolCapacity(rows=128, calls=160)
    assert prompt == PoolCapacity(rows=32, calls=40, shared_rows=PROMPT_SLOTS_SHARED_PER_WORKER)
    decode, on_decode = pool.capacities(prompts_on_decode=True)
    assert on_decode == PoolCapacity(128, 160, shared_rows=2 * PROMPT_SLOTS_SHARED_PER_WORKER)


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
