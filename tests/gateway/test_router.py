"""Routing decisions with exact expected workers (pure logic, registry snapshots as input)."""

from __future__ import annotations

from nori.gateway.worker_pool import Router
from nori.state.registry import WorkerInfo


def decode(worker_id: str, free: int, total: int = 100, **extra: object) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role="decode",
        num_free_blocks=free,
        num_total_blocks=total,
        **extra,  # type: ignore[arg-type]
    )


def prefill(worker_id: str, **extra: object) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="prefill", **extra)  # type: ignore[arg-type]


def test_decode_prefers_fewer_in_flight_then_more_free_blocks() -> None:
    router = Router()
    workers = [decode("d0", free=10), decode("d1", free=90), prefill("p0")]
    assert router.pick_decode(workers).worker_id == "d1"  # type: ignore[union-attr]
    router.started("d1")
    # A burst: the gateway's own count spreads it before heartbeats catch up.
    assert router.pick_decode(workers).worker_id == "d0"  # type: ignore[union-attr]
    router.started("d0")
    assert router.pick_decode(workers).worker_id == "d1"  # type: ignore[union-attr]
    router.ended("d1")
    router.ended("d0")
    assert not router.in_flight and not router.pending_prompt_tokens


def test_decode_skips_draining_excluded_and_prefill_workers() -> None:
    router = Router()
    workers = [decode("d0", free=90, draining=True), decode("d1", free=5), prefill("p0")]
    assert router.pick_decode(workers).worker_id == "d1"  # type: ignore[union-attr]
    assert router.pick_decode(workers, exclude=["d1"]) is None
    colocated = WorkerInfo(worker_id="c0", role="colocated", num_total_blocks=10)
    assert router.pick_decode([colocated]).worker_id == "c0"  # type: ignore[union-attr]


def test_prefill_prefers_the_longest_cached_prefix_unless_it_is_busier() -> None:
    router = Router()
    workers = [prefill("p0"), prefill("p1"), decode("d0", free=1)]
    cached = {"p1": 4 * 16}  # 64 of the prompt's 100 tokens are cached on p1
    assert router.pick_prefill(workers, cached, 100).worker_id == "p1"  # type: ignore[union-attr]
    router.started("p1", prompt_tokens=70)  # p1 now has 70 queued tokens: 36 + 70 > 100
    assert router.pick_prefill(workers, cached, 100).worker_id == "p0"  # type: ignore[union-attr]
    # A cached prefix never counts for more than the prompt itself.
    assert router.pick_prefill(workers, {"p0": 100}, 20).worker_id == "p0"  # type: ignore[union-attr]
    assert router.pick_prefill([decode("d0", free=1)], {}, 10) is None
    assert router.pick_prefill([prefill("p9", draining=True)], {}, 10) is None


def test_equal_decode_workers_take_turns() -> None:
    router = Router()
    workers = [decode("d2", free=50), decode("d0", free=50), decode("d1", free=50)]
    picks = [router.pick_decode(workers).worker_id for _ in range(6)]  # type: ignore[union-attr]
    assert picks == ["d0", "d1", "d2", "d0", "d1", "d2"]
