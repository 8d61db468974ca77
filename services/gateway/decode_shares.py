"""Fair shares of the decode pool: who holds its calls, so that one request or one client cannot
take it all (`DecodeShares`), and what the pool holds (`PoolCapacity`, from the workers' GetStats).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nori.gateway.errors import ShareRefusedError


@dataclass(frozen=True)
class PoolCapacity:
    """What the decode (or colocated) workers hold at once, summed over the pool, as each
    reports it in GetStats: running batch rows (`--max-num-seqs`) and calls served at once
    (the batch plus its bounded queue, past which a worker answers RESOURCE_EXHAUSTED)."""

    rows: int
    calls: int


def pool_capacity(
    figures: Mapping[str, tuple[int, int]], worker_ids: Sequence[str]
) -> PoolCapacity | None:
    """The decode pool's capacity from its workers' (rows, calls). A worker that joined since
    the last GetStats round has not said yet: it counts as the mean of the others (workers of
    one pool run one configuration), not as nothing, which would hold a lone client to the
    first worker's share for up to a round. None while no worker has said."""
    known = [figures[worker_id] for worker_id in worker_ids if worker_id in figures]
    if not known:
        return None
    scale = len(worker_ids) / len(known)
    return PoolCapacity(
        rows=round(sum(rows for rows, _ in known) * scale),
        calls=round(sum(calls for _, calls in known) * scale),
    )


class DecodeShares:
    """Who holds the decode pool's calls, so that one request or one client cannot take it all.

    Every member (one prompt's one choice) holds a share from its routing to its end. Owners
    are its request (`group`: the HTTP request) and its `client` (the API key, else the client
    address). A member may start when

    - the pool has a call free (`calls`: more never go out, so a batch of thousands never
      floods a worker's gRPC server, see `cluster.py`), and
    - each of its owners holds fewer than its limit: the pool's running batch (`rows`) when it
      is the only owner active (work-conserving: a lone request fills every row, and the calls
      beyond the rows, the workers' queues, stay free for a newcomer, whose first token then
      comes at once), or `max_share` of the rows while another owner holds or waits.

    Members that may not start wait here, not on a worker, and a freed call goes to the waiter
    whose client, then request, holds the least (first come on ties): a single request of
    another user goes before the next member of a big batch. With no capacity known (no
    worker has said), nothing is limited.
    """

    def __init__(self, max_share: float = 0.5) -> None:
        if not 0 < max_share <= 1:
            raise ValueError(f"--max-decode-share must be in (0, 1], got {max_share}")
        self.max_share = max_share
        self.capacity: PoolCapacity | None = None
        self.num_held = 0
        # Of those, members of background (batch) work.
        self.num_background_held = 0
        # Members held per owner key, and members held or waiting per owner key ("active").
        self._held: Counter[str] = Counter()
        self._active: Counter[str] = Counter()
        self._num_active_groups = 0
        self._num_active_clients = 0
        # Waiters in arrival order, one line per (request, client): a freed call looks at the
        # first of each line only, so a batch of thousands waiting costs one look, not one each.
        self._waiters: dict[tuple[str, str], deque[_ShareWaiter]] = {}
        self._arrivals = 0

    def set_capacity(self, capacity: PoolCapacity | None) -> None:
        self.capacity = capacity
        self._grant_waiters()

    def limit(self, key: str, num_active_owners: int) -> int:
        """The most members owner `key` may hold now."""
        assert self.capacity is not None
        others_active = num_active_owners > 1 or (num_active_owners == 1 and not self._active[key])
        if not others_active:
            return max(1, self.capacity.rows)
        return max(1, math.floor(self.max_share * self.capacity.rows))

    def may_start(self, group: str, client: str, priority: int = 0) -> bool:
        """Background members (a priority above 0: batch lines) may fill the running rows but
        never the calls beyond them, the workers' queues. An interactive member is measured
        against the interactive members held only, as the workers measure its call (see
        `EngineServicer._open`) and the engine schedules it, ahead of every batch line: a
        batch cannot make an interactive request's share a 429."""
        if self.capacity is None:
            return True
        g, c = _group_key(group), _client_key(client)
        num_held, calls = self._calls_for(priority)
        return (
            num_held < calls
            and self._held[g] < self.limit(g, self._num_active_groups)
            and self._held[c] < self.limit(c, self._num_active_clients)
        )

    def try_take(self, group: str, client: str, priority: int = 0) -> DecodeShare | None:
        """A share at once, or None (the caller waits or refuses)."""
        if not self.may_start(group, client, priority):
            return None
        self._enter(group, client)
        return self._grant(group, client, priority)

    async def take(self, group: str, client: str, wait_s: float, priority: int = 0) -> DecodeShare:
        """A share, waiting at most `wait_s` for it; ShareRefusedError (429) past that. Freed
        shares go to waiters of the lowest `priority` value first (interactive before batch)."""
        share = self.try_take(group, client, priority)
        if share is not None:
            return share
        if wait_s <= 0:
            raise self._refusal(group, client, priority)
        self._enter(group, client)
        self._arrivals += 1
        waiter = _ShareWaiter(
            group, client, self._arrivals, asyncio.get_running_loop().create_future(), priority
        )
        self._waiters.setdefault((group, client), deque()).append(waiter)
        try:
            async with asyncio.timeout(wait_s):
                return await waiter.future
        except BaseException as error:
            if waiter.future.done() and not waiter.future.cancelled():
                waiter.future.result().release()  # granted just as the wait ended
            else:
                self._drop_waiter(waiter)
                self._leave_active(group, client)
            if isinstance(error, TimeoutError):
                raise self._refusal(group, client, priority) from None
            raise

    def _calls_for(self, priority: int) -> tuple[int, int]:
        """(members counted, their limit) for a member of `priority`: an interactive one counts
        the interactive members against every call; a background one counts all members
        against the calls up to the running rows."""
        assert self.capacity is not None
        if priority <= 0:
            return self.num_held - self.num_background_held, self.capacity.calls
        return self.num_held, min(self.capacity.calls, self.capacity.rows)

    def _refusal(self, group: str, client: str, priority: int) -> ShareRefusedError:
        assert self.capacity is not None
        g, c = _group_key(group), _client_key(client)
        at_rows = max(1, self.capacity.rows)
        num_held, calls = self._calls_for(priority)
        if num_held >= calls and priority <= 0:
            message = (
                f"the decode pool is full: {num_held} interactive requests hold its {calls} calls"
            )
        elif num_held >= calls:
            message = (
                f"the decode pool is full for background work: {num_held} requests hold "
                f"its {calls} running slots"
            )
        elif self._held[g] >= at_rows or self._held[c] >= at_rows:
            # Alone, an owner may fill every running slot, and it has: the pool is full for it.
            message = (
                f"the decode pool is full: this client's requests hold all of its "
                f"{self.capacity.rows} running slots"
            )
        else:
            message = (
                "this client or request holds its share of the decode pool "
                f"({self.max_share:g} of its {self.capacity.rows} running slots) while others wait"
            )
        return ShareRefusedError(
            message + "; retry after the time in Retry-After", retry_after_s=1.0
        )

    def _enter(self, group: str, client: str) -> None:
        g, c = _group_key(group), _client_key(client)
        if not self._active[g]:
            self._num_active_groups += 1
        if not self._active[c]:
            self._num_active_clients += 1
        self._active[g] += 1
        self._active[c] += 1

    def _leave_active(self, group: str, client: str) -> None:
        for key in (_group_key(group), _client_key(client)):
            self._active[key] -= 1
            if self._active[key] <= 0:
                del self._active[key]
                if key.startswith("g:"):
                    self._num_active_groups -= 1
                else:
                    self._num_active_clients -= 1

    def _grant(self, group: str, client: str, priority: int) -> DecodeShare:
        self.num_held += 1
        if priority > 0:
            self.num_background_held += 1
        self._held[_group_key(group)] += 1
        self._held[_client_key(client)] += 1
        return DecodeShare(self, group, client, priority)

    def _release(self, group: str, client: str, priority: int) -> None:
        self.num_held -= 1
        if priority > 0:
            self.num_background_held -= 1
        for key in (_group_key(group), _client_key(client)):
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]
        self._leave_active(group, client)
        self._grant_waiters()

    def _drop_waiter(self, waiter: _ShareWaiter) -> None:
        line = self._waiters.get((waiter.group, waiter.client))
        if line is not None and waiter in line:
            line.remove(waiter)
            if not line:
                del self._waiters[(waiter.group, waiter.client)]

    def _grant_waiters(self) -> None:
        """Freed calls to the waiters of the most urgent priority, then whose client, then
        request, holds the least (first come on ties), while any may start."""
        while self._waiters:
            # A waiter whose task was cancelled leaves its line when that task next runs; until
            # then its future is done (cancelled) and it must not be granted anything.
            for line in list(self._waiters.values()):
                while line and line[0].future.done():
                    self._drop_waiter(line[0])
            heads = [
                line[0]
                for line in self._waiters.values()
                if self.may_start(line[0].group, line[0].client, line[0].priority)
            ]
            if not heads:
                return
            chosen = min(
                heads,
                key=lambda w: (
                    w.priority,
                    self._held[_client_key(w.client)],
                    self._held[_group_key(w.group)],
                    w.arrival,
                ),
            )
            self._drop_waiter(chosen)
            chosen.future.set_result(self._grant(chosen.group, chosen.client, chosen.priority))

    @property
    def num_waiting(self) -> int:
        return sum(len(line) for line in self._waiters.values())


def _group_key(group: str) -> str:
    return f"g:{group}"


def _client_key(client: str) -> str:
    return f"c:{client}"


@dataclass
class _ShareWaiter:
    group: str
    client: str
    arrival: int
    future: asyncio.Future[DecodeShare]
    priority: int = 0


class DecodeShare:
    """One member's hold on the decode pool; released exactly once (which may start a waiter)."""

    def __init__(self, shares: DecodeShares, group: str, client: str, priority: int = 0) -> None:
        self._shares = shares
        self.group = group
        self.client = client
        self.priority = priority
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._shares._release(self.group, self.client, self.priority)
