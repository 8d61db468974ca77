"""Which block size the cluster runs with, and which workers it leaves out (pure logic)."""

from __future__ import annotations

from nori.gateway.worker_pool import agree_on_block_size
from nori.state.registry import WorkerInfo


def worker(worker_id: str, block_size: int, started_at: float) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id, role="decode", block_size=block_size, started_at=started_at
    )


def ids(workers: list[WorkerInfo]) -> list[str]:
    return [w.worker_id for w in workers]


def test_the_longest_running_worker_sets_the_block_size() -> None:
    workers = [worker("late", 32, 200.0), worker("first", 16, 100.0), worker("second", 16, 150.0)]
    agreement = agree_on_block_size(workers, expected=None)
    assert agreement.block_size == 16
    assert ids(agreement.members) == ["first", "second"]
    assert ids(agreement.refused) == ["late"]


def test_an_explicit_block_size_wins() -> None:
    workers = [worker("first", 16, 100.0), worker("late", 32, 200.0)]
    agreement = agree_on_block_size(workers, expected=32)
    assert agreement.block_size == 32
    assert ids(agreement.members) == ["late"] and ids(agreement.refused) == ["first"]


def test_workers_that_state_no_size_are_kept_and_none_is_known_without_one() -> None:
    silent = worker("old-version", 0, 50.0)
    assert agree_on_block_size([silent], expected=None).block_size is None
    agreement = agree_on_block_size([silent, worker("new", 16, 100.0)], expected=None)
    assert agreement.block_size == 16
    assert ids(agreement.members) == ["old-version", "new"] and agreement.refused == []
    assert agree_on_block_size([], expected=None).block_size is None
