"""Keeps the decode reservations of the prompts this worker holds alive.

From a Prefill call's arrival until its KV is sent, this worker renews the decode worker's lease
(`services/decode/lease.py`): one `RenewLeases` per decode worker, on arrival and every third of
the shortest lease held, saying which prompts have started. If the process stops or its engine
wedges, renewals stop and the blocks are freed one lease later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

RenewCall = Callable[[str, list[tuple[str, bool]], float], Awaitable[list[str]]]

RENEWALS_PER_LEASE = 3
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
            self._wake.clear()
            await self.renew_once()
            # A new prompt's first renewal goes out at once (its lease began before it arrived);
            # prompts arriving together share a round.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.period_s())
