"""A reservation's lease on an exact clock: renewals, the queue bound, the transfer bound."""

from __future__ import annotations

import math

import pytest

from nori.decode.kv_sink import Lease, LeasePolicy, LeaseState

POLICY = LeasePolicy(lease_s=2.0, queue_timeout_s=10.0, transfer_timeout_s=5.0)


def reserve(now: float = 100.0) -> Lease:
    return Lease.reserve("r1", [4, 5], POLICY, now)


def test_the_reservation_itself_gives_one_lease_to_reach_a_prefill_worker() -> None:
    lease = reserve()
    assert lease.state is LeaseState.QUEUED and lease.deadline() == 102.0
    assert lease.is_live(101.9) and not lease.is_live(102.0)
    assert "no prefill worker took the prompt up within 2 s" in str(lease.expiry())


def test_renewals_keep_a_queued_prompt_alive_until_the_queue_bound() -> None:
    lease = reserve()
    # Renewed every second while the prompt waits: the lease never runs out on its own...
    for now in range(101, 109):
        assert lease.renew(float(now), started=False)
        assert lease.deadline() == now + 2.0
    # ...but the queue bound (10 s after the reservation) caps it.
    assert lease.renew(109.0, started=False)
    assert lease.deadline() == 110.0
    assert not lease.renew(110.0, started=False)
    assert lease.state is LeaseState.QUEUED
    assert "waited more than 10 s in the prefill queue" in str(lease.expiry())


def test_a_started_prompt_has_no_queue_bound_only_the_lease() -> None:
    lease = reserve()
    for now in range(101, 109):
        assert lease.renew(float(now), started=False)
    assert lease.renew(109.0, started=True)
    assert lease.state is LeaseState.COMPUTING and lease.deadline() == 111.0
    # A long prompt, renewed all along, lives past the queue bound.
    for now in range(110, 130):
        assert lease.renew(float(now), started=True)
    assert lease.deadline() == 131.0
    # Then its prefill worker hangs: silence for one lease ends it.
    assert not lease.is_live(131.0)
    message = str(lease.expiry())
    assert "did not arrive within the lease" in message
    assert "stopped renewing it for 2 s (hung or dead) while the prompt was computing" in message


def test_a_late_renewal_never_revives_a_lease() -> None:
    lease = reserve()
    assert lease.renew(101.5, started=False)
    assert not lease.renew(103.5, started=True)  # 2 s of silence: over
    assert lease.state is LeaseState.QUEUED and lease.deadline() == 103.5


def test_a_transfer_under_way_has_its_own_bound_and_ignores_renewals() -> None:
    lease = reserve()
    lease.start_receiving(101.0)
    assert lease.deadline() == 106.0
    assert lease.renew(105.0, started=True)  # harmless: the holder is still sending
    assert lease.state is LeaseState.RECEIVING and lease.deadline() == 106.0
    lease.state = LeaseState.ARRIVED
    assert lease.deadline() == math.inf and not lease.renew(107.0, started=True)


def test_policy_rejects_non_positive_timeouts() -> None:
    with pytest.raises(ValueError, match="positive"):
        LeasePolicy(lease_s=0)
