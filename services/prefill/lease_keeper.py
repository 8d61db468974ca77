"""Keeps the decode reservations of the prompts this worker holds alive.

A decode worker reserves blocks for a prompt under a lease (`services/decode/lease.py`) that must
outlast our queue and compute, yet run out when we hang or die. So this worker vouches for every
prompt it holds, from the Prefill call's arrival until its KV is sent: on arrival, and then every
third of the shortest lease it holds, one `RenewLeases` call per decode worker renews all of that
worker's reservations, saying which prompts the engine has started. If this process stops or its
engine wedges (`engine_responsive` turns False), the renewals stop and the blocks are freed one
lease later. Failed renewals are retried next round; a request the decode worker no longer knows
is not asked again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# (decode worker's gRPC address, [(request id, started)], timeout) -> request ids it does not know.
RenewCall = Callable[[str, list[tuple[str, bool]], float], Awaitable[list[str]]]

# Renewals per lease: one lost or late renewal still leaves two before the lease runs out.
RENEWALS_PER_LEASE = 3
# Fastest renewal round, so a very short lease cannot turn renewals into a busy loop.
MIN_PERIOD_S = 0.05


@dataclass
class _Held:
    address: str
    lease_s: float
    started: bool = False


class LeaseKeeper:
    def __init__(self, renew: RenewCall, engine_responsive: Callable[[], bool]) -> None:
        self._renew = renew
        self._engine_responsive = engine_responsive
        self._held: dict[str, _Held] = {}
        self._wake = asyncio.Event()
        self._engine_was_responsive = True

    def hold(self, request_id: str, address: str, lease_s: float) -> None:
        """From now until `release`, this worker vouches for the request's reservation."""
        if not address or lease_s <= 0:
            return  # a gateway that sends no renewal address: the lease simply runs
        self._held[request_id] = _Held(address, lease_s)
        self._wake.set()

    def started(self, request_ids: Iterable[str]) -> None:
        """The engine has begun computing these prompts (they left the queue)."""
        for request_id in request_ids:
            held = self._held.get(request_id)
            if held is not None:
                held.started = True

    def release(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def period_s(self) -> float:
        if not self._held:
            return 1.0
        shortest = min(held.lease_s for held in self._held.values())
        return max(MIN_PERIOD_S, shortest / RENEWALS_PER_LEASE)

    def batches(self) -> dict[str, list[tuple[str, bool]]]:
        """What one round sends: per decode worker, every request held for it."""
        batches: dict[str, list[tuple[str, bool]]] = {}
        for request_id, held in self._held.items():
            batches.setdefault(held.address, []).append((request_id, held.started))
        return batches

    async def renew_once(self) -> None:
        responsive = self._engine_responsive()
        if responsive != self._engine_was_responsive:
            self._engine_was_responsive = responsive
            if not responsive:
                logger.error(
                    "the engine thread is dead or stalled: no longer renewing the decode leases "
                    "of %d request(s); their decode workers will free the blocks",
                    len(self._held),
                )
        if not responsive:
            return
        timeout_s = self.period_s()
        await asyncio.gather(
            *(
                self._renew_batch(address, batch, timeout_s)
                for address, batch in self.batches().items()
            )
        )

    async def _renew_batch(
        self, address: str, batch: list[tuple[str, bool]], timeout_s: float
    ) -> None:
        try:
            unknown = await self._renew(address, batch, timeout_s)
        except Exception as error:
            # The next round tries again; the lease leaves room for two misses.
            logger.warning("could not renew %d lease(s) on %s: %s", len(batch), address, error)
            return
        for request_id in unknown:
            self._held.pop(request_id, None)

    async def run(self) -> None:
        """Renews every held lease each period, and at once when a prompt arrives, until
        cancelled."""
        while True:
            if not self._held:
                await self._wake.wait()
            # Cleared before the round: a prompt arriving during it wakes the next one at once.
            self._wake.clear()
            await self.renew_once()
            # A new prompt's first renewal goes out at once: until then only the reservation
            # vouches for it, and that lease began before the prompt travelled to us. Prompts
            # arriving together share a round.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.period_s())
