"""Routing decisions with exact expected workers (pure logic, registry snapshots as input)."""

from __future__ import annotations

from collections.abc import Iterable

from nori.gateway.ledger import Ledger
from nori.gateway.worker_pool import pick_decode, pick_prefill
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


def decode_pick(
    ledger: Ledger, workers: list[WorkerInfo], exclude: Iterable[str] = ()
) -> WorkerInfo | None:
    return pick_decode(workers, ledger.in_flight, ledger.turn("decode"), exclude)


def prefill_pick(
    ledger: Ledger, workers: list[WorkerInfo], cached: dict[str, int], num_tokens: int
) -> WorkerInfo | None:
    in_flight, pending = ledger.in_flight, ledger.pending_prompt_tokens
    return pick_prefill(workers, in_flight, pending, cached, num_tokens, ledger.turn("prefill"))


def test_decode_prefers_fewer_in_flight_then_more_free_blocks() -> None:
    ledger = Ledger()
    workers = [decode("d0", free=10), decode("d1", free=90), prefill("p0")]
    assert decode_pick(ledger, workers).worker_id == "d1"  # type: ignore[union-attr]
    ledger.worker_started("d1")
    # A burst: the gateway's own count spreads it before heartbeats catch up.
    assert decode_pick(ledger, workers).worker_id == "d0"  # type: ignore[union-attr]
    ledger.worker_started("d0")
    assert decode_pick(ledger, workers).worker_id == "d1"  # type: ignore[union-attr]
    ledger.worker_ended("d1")
    ledger.worker_ended("d0")
    assert not ledger.in_flight and not ledger.pending_prompt_tokens


def test_decode_skips_draining_excluded_and_prefill_workers() -> None:
    ledger = Ledger()
    workers = [decode("d0", free=90, draining=True), decode("d1", free=5), prefill("p0")]
    assert decode_pick(ledger, workers).worker_id == "d1"  # type: ignore[union-attr]
    assert decode_pick(ledger, workers, exclude=["d1"]) is None
    colocated = WorkerInfo(worker_id="c0", role="colocated", num_total_blocks=10)
    assert decode_pick(ledger, [colocated]).worker_id == "c0"  # type: ignore[union-attr]


def test_prefill_prefers_the_longest_cached_prefix_unless_it_is_busier() -> None:
    ledger = Ledger()
    workers = [prefill("p0"), prefill("p1"), decode("d0", free=1)]
    cached = {"p1": 4 * 16}  # 64 of the prompt's 100 tokens are cached on p1
    assert prefill_pick(ledger, workers, cached, 100).worker_id == "p1"  # type: ignore[union-attr]
    ledger.worker_started("p1", prompt_tokens=70)  # p1 now has 70 queued tokens: 36 + 70 > 100
    assert prefill_pick(ledger, workers, cached, 100).worker_id == "p0"  # type: ignore[union-attr]
    # A cached prefix never counts for more than the prompt itself.
    assert prefill_pick(ledger, workers, {"p0": 100}, 20).worker_id == "p0"  # type: ignore[union-attr]
    assert prefill_pick(ledger, [decode("d0", free=1)], {}, 10) is None
    assert prefill_pick(ledger, [prefill("p9", draining=True)], {}, 10) is None


def test_equal_decode_workers_take_turns() -> None:
    ledger = Ledger()
    workers = [decode("d2", free=50), decode("d0", free=50), decode("d1", free=50)]
    picks = [decode_pick(ledger, workers).worker_id for _ in range(6)]  # type: ignore[union-attr]
    assert picks == ["d0", "d1", "d2", "d0", "d1", "d2"]
