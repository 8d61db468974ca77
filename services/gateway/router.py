"""Which workers serve a request. Pure logic over registry snapshots and the gateway's own counts.

Registry load figures are up to a heartbeat old, so a burst of requests would all see the same
"least loaded" worker; the gateway's own in-flight counts (updated the moment it routes) break
such ties and spread a burst across the pool.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from nori.state.registry import WorkerInfo


@dataclass
class Router:
    # Requests this gateway has routed to each worker and not yet seen finish.
    in_flight: Counter[str] = field(default_factory=Counter)
    # Prompt tokens this gateway has sent to each prefill worker and not yet seen prefilled.
    pending_prompt_tokens: Counter[str] = field(default_factory=Counter)
    _decode_picks: int = 0
    _prefill_picks: int = 0

    def pick_decode(
        self, workers: Iterable[WorkerInfo], exclude: Iterable[str] = ()
    ) -> WorkerInfo | None:
        """The decode (or colocated) worker with the fewest in-flight requests, then the most
        free KV blocks."""
        excluded = set(exclude)
        candidates = [
            worker
            for worker in workers
            if worker.role in ("decode", "colocated")
            and not worker.draining
            and worker.worker_id not in excluded
        ]
        if not candidates:
            return None
        # Equal workers take turns (min keeps the first of equals; the start rotates), so
        # requests that arrive one at a time still spread over an idle pool.
        candidates.sort(key=lambda w: w.worker_id)
        start = self._decode_picks % len(candidates)
        self._decode_picks += 1
        return min(
            candidates[start:] + candidates[:start],
            key=lambda w: (
                self.in_flight[w.worker_id],
                -round(_free_share(w), 2),
                w.num_running + w.num_waiting,
            ),
        )

    def pick_prefill(
        self,
        workers: Iterable[WorkerInfo],
        cached_tokens: Mapping[str, int],
        num_prompt_tokens: int,
    ) -> WorkerInfo | None:
        """The prefill worker that would compute the fewest tokens before this prompt is done:
        the prompt minus its cached prefix there (`cached_tokens`, per worker), plus what is
        already queued on it."""
        candidates = [w for w in workers if w.role == "prefill" and not w.draining]
        if not candidates:
            return None

        def cost(worker: WorkerInfo) -> tuple[int, int]:
            cached = min(cached_tokens.get(worker.worker_id, 0), num_prompt_tokens)
            queued = self.pending_prompt_tokens[worker.worker_id]
            return (num_prompt_tokens - cached + queued, self.in_flight[worker.worker_id])

        # As for decode: equal workers take turns.
        candidates.sort(key=lambda w: w.worker_id)
        start = self._prefill_picks % len(candidates)
        self._prefill_picks += 1
        return min(candidates[start:] + candidates[:start], key=cost)

    def started(self, worker_id: str, prompt_tokens: int = 0) -> None:
        self.in_flight[worker_id] += 1
        self.pending_prompt_tokens[worker_id] += prompt_tokens

    def ended(self, worker_id: str, prompt_tokens: int = 0) -> None:
        self.in_flight[worker_id] -= 1
        self.pending_prompt_tokens[worker_id] -= prompt_tokens
        # Drop zero entries: worker ids come and go, the counters must not grow with them.
        if self.in_flight[worker_id] <= 0:
            del self.in_flight[worker_id]
        if self.pending_prompt_tokens[worker_id] <= 0:
            del self.pending_prompt_tokens[worker_id]


def _free_share(worker: WorkerInfo) -> float:
    if worker.num_total_blocks <= 0:
        return 0.0
    return worker.num_free_blocks / worker.num_total_blocks
