"""`RequestTicket`: one request's holds in the gateway's `ledger.Ledger`, from admission to
`close()`. Its states: `queued` -> `prompt` (on a worker) -> `decoding` (token one came) ->
`closed`. Retries and migration move it between workers, never out of the ledger; `close()`,
once in `ClusterBackend.generate`'s `finally`, releases whatever it still holds.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from nori.gateway.backend import GenerationRequest

if TYPE_CHECKING:
    from nori.gateway.ledger import Ledger


class RequestTicket:
    def __init__(self, ledger: Ledger, request: GenerationRequest) -> None:
        self.ledger = ledger
        self.request_id = request.request_id
        self.group = request.admission_group
        self.priority = request.priority
        self.background = request.priority > 0
        self.waits = request.admission_group is not None or self.background
        # Batch lines are an owner apart from the same key's interactive work.
        self.client = f"{request.client}#background" if self.background else request.client
        self.group_key = f"g:{self.group or request.request_id}"
        self.client_key = f"c:{self.client}"
        self.line = (self.group_key, self.client_key)
        self.num_tokens = len(request.prompt_token_ids)
        self.admitted = False  # counted among the requests in flight
        self.in_group = False  # counted in its group, until token one
        self.active = False  # holds or waits for a slot
        self.slot = False  # holds a decode-pool slot
        self.prompting = False  # holds a prompt-pool slot; its tokens are queued
        self.first_token_at: float | None = None
        self.prompt_worker: tuple[str, bool] | None = None  # (worker, counted in flight there)
        self.decode_worker: str | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.arrival = 0
        self.closed = False

    @property
    def state(self) -> str:
        if self.closed:
            return "closed"
        if self.first_token_at is not None:
            return "decoding"
        return "prompt" if self.prompt_worker is not None else "queued"

    async def take(self, wait_s: float) -> None:
        """Takes a slot, waiting up to `wait_s` for one (`ShareRefusedError`, 429, past it)."""
        ledger = self.ledger
        if ledger.may_start(self):
            self.take_slot()
            return
        if wait_s <= 0:
            raise ledger.slot_refusal(self)
        self._activate()
        try:
            async with asyncio.timeout(wait_s):
                await ledger._enqueue(self)
        except TimeoutError:
            if not self.slot:  # else granted just as the wait ended: it keeps the slot
                ledger._drop_waiter(self)
                raise ledger.slot_refusal(self) from None

    def take_slot(self) -> None:
        self._activate()
        self.slot = self.prompting = True
        self.ledger._hold(self, +1, prompt=False)
        self.ledger._hold(self, +1, prompt=True)
        self.ledger._count_tokens(self, +1)

    def _activate(self) -> None:
        if not self.active:
            self.active = True
            self.ledger._activity(self, +1)

    def prompt_on(self, worker_id: str, whole_request: bool = True) -> None:
        """Its prompt goes to `worker_id`, counted there until token one (as tokens only when
        the decode worker, where the request is counted already, computes it)."""
        self.prompt_off()
        self.prompt_worker = (worker_id, whole_request)
        if whole_request:
            self.ledger.router.started(worker_id, self.num_tokens)
        else:
            self.ledger.router.prompt_started(worker_id, self.num_tokens)

    def prompt_off(self) -> None:
        if self.prompt_worker is not None:
            worker_id, whole_request = self.prompt_worker
            self.prompt_worker = None
            if whole_request:
                self.ledger.router.ended(worker_id, self.num_tokens)
            else:
                self.ledger.router.prompt_done(worker_id, self.num_tokens)

    def decoding_on(self, worker_id: str) -> None:
        """An attempt on decode worker `worker_id`, counted in flight there until `decoding_off`."""
        self.decoding_off()
        self.decode_worker = worker_id
        self.ledger.router.started(worker_id)

    def decoding_off(self) -> None:
        if self.decode_worker is not None:
            self.ledger.router.ended(self.decode_worker)
            self.decode_worker = None

    def first_token(self, now: float) -> None:
        """Token one came back: its prompt no longer waits."""
        if self.first_token_at is None and not self.closed:
            self.first_token_at = now
            self.prompt_off()
            self._leave_prompt(drained_at=now)
            self.ledger._grant_waiters()

    def _leave_prompt(self, drained_at: float | None) -> None:
        if self.prompting:
            self.prompting = False
            self.ledger._hold(self, -1, prompt=True)
            self.ledger._count_tokens(self, -1)
            if drained_at is not None:
                self.ledger._drained.append((drained_at, self.num_tokens))
        if self.in_group and self.group is not None:
            self.in_group = False
            self.ledger._leave_group(self.group)

    def close(self) -> None:
        """Releases everything the ticket holds; a no-op after the first time."""
        if self.closed:
            return
        ledger = self.ledger
        self.prompt_off()
        self.decoding_off()
        if self.waiter is not None and not self.slot:
            ledger._drop_waiter(self)
        self._leave_prompt(drained_at=None)
        self.closed = True
        if self.slot:
            self.slot = False
            ledger._hold(self, -1, prompt=False)
        if self.active:
            self.active = False
            ledger._activity(self, -1)
        if self.admitted:
            self.admitted = False
            ledger.num_open -= 1
        ledger._grant_waiters()
