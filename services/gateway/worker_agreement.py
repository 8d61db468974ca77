"""What every worker of a cluster must share with the others, and which workers do not (pure
logic over registry entries; `WorkerPool` routes only to the members and logs the refused).

All agree on the KV layout (block size, cache dtype) and speculative decoding. The cluster's
settings are its longest-running worker's: a newcomer with other flags is refused, not obeyed."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from nori.repeated_log import RepeatedFailureLog
from nori.state.registry import RefusedEntry, WorkerInfo

logger = logging.getLogger("nori.gateway.worker_pool")

# Refused worker ids logged once each; past this many (forged entries) they are only counted.
MAX_LOGGED_REFUSALS = 1024


@dataclass(frozen=True)
class KVLayoutAgreement:
    """The cluster's KV layout (block size, cache dtype), the workers that use it and the rest."""

    block_size: int | None
    kv_cache_dtype: str | None
    members: list[WorkerInfo]
    refused: list[WorkerInfo]


def agree_on_kv_layout(workers: Sequence[WorkerInfo], expected: int | None) -> KVLayoutAgreement:
    """The block size `expected` when given; else, as the KV cache dtype, what the
    longest-running worker states. A worker stating neither (0 / "") is taken to match."""
    by_age = sorted(workers, key=lambda w: w.started_at)
    sizes = [w.block_size for w in by_age if w.block_size > 0]
    block_size = expected if expected is not None else (sizes[0] if sizes else None)
    dtypes = [w.kv_cache_dtype for w in by_age if w.kv_cache_dtype]
    kv_cache_dtype = dtypes[0] if dtypes else None
    members: list[WorkerInfo] = []
    refused: list[WorkerInfo] = []
    for w in workers:
        fits = w.block_size in (0, block_size) and w.kv_cache_dtype in ("", kv_cache_dtype)
        (members if fits else refused).append(w)
    return KVLayoutAgreement(block_size, kv_cache_dtype, members, refused)


@dataclass(frozen=True)
class SpeculationAgreement:
    """The cluster's `speculative_config` (canonical JSON, "" for off; None: no worker), who
    runs it and who does not."""

    speculative_config: str | None
    members: list[WorkerInfo]
    refused: list[WorkerInfo]


def agree_on_speculation(workers: Sequence[WorkerInfo]) -> SpeculationAgreement:
    """The longest-running worker's speculative settings. Unlike the dtype, "" is a setting,
    not silence: a worker without the field runs without speculation."""
    if not workers:
        return SpeculationAgreement(None, [], [])
    cluster = min(workers, key=lambda w: w.started_at).speculative_config
    members = [w for w in workers if w.speculative_config == cluster]
    refused = [w for w in workers if w.speculative_config != cluster]
    return SpeculationAgreement(cluster, members, refused)


def describe_speculation(speculative_config: str | None) -> str:
    """A worker's speculative setting as a log line names it."""
    return speculative_config or "off"


class RefusalLog:
    """One log line per refused worker (again only if it leaves and comes back), and the
    refused registry entries counted by reason."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._refused: set[tuple[str, int, str]] = set()
        self._refused_speculation: set[tuple[str, str]] = set()
        self._refused_versions: set[tuple[str, str]] = set()
        self._logged_refusals: set[str] = set()
        self._unlogged_refusals = RepeatedFailureLog(logger, "refusing unverified worker entries")

    def entries(self, refused: list[RefusedEntry]) -> None:
        """Counts each refused write once and logs each refused worker id once (a forged entry
        stays in Redis and is read on every refresh)."""
        versions = {(entry.worker_id, entry.version) for entry in refused}
        for entry in refused:
            if (entry.worker_id, entry.version) in self._refused_versions:
                continue
            self.counts[entry.reason] = self.counts.get(entry.reason, 0) + 1
            if entry.worker_id in self._logged_refusals:
                continue
            if len(self._logged_refusals) >= MAX_LOGGED_REFUSALS:
                self._unlogged_refusals.failed(ValueError(f"{entry.worker_id}: {entry.reason}"))
                continue
            self._logged_refusals.add(entry.worker_id)
            logger.error(
                "refusing worker entry %s: %s (not signed with this cluster's secret, or out "
                "of date); nothing is routed to it",
                entry.worker_id,
                {
                    "unsigned": "it carries no signature",
                    "forged": "its signature does not verify",
                    "expired": "it has expired",
                }[entry.reason],
            )
        self._refused_versions = versions

    def layouts(self, agreement: KVLayoutAgreement) -> None:
        refused = {(w.worker_id, w.block_size, w.kv_cache_dtype) for w in agreement.refused}
        for worker_id, size, dtype in sorted(refused - self._refused):
            logger.error(
                "refusing worker %s: its KV blocks are %d tokens of %s, the cluster's are %s "
                "tokens of %s (every worker must run with the same --block-size, --dtype and "
                "--kv-cache-dtype)",
                worker_id,
                size,
                dtype or "an unstated dtype",
                agreement.block_size,
                agreement.kv_cache_dtype,
            )
        self._refused = refused

    def speculation(self, agreement: SpeculationAgreement) -> None:
        """One line per refused worker and setting (again only if it leaves and comes back)."""
        refused = {(w.worker_id, w.speculative_config) for w in agreement.refused}
        for worker_id, speculative_config in sorted(refused - self._refused_speculation):
            logger.error(
                "refusing worker %s: its speculative decoding is %s, the cluster's is %s (every "
                "worker must run with the same --speculative-config)",
                worker_id,
                describe_speculation(speculative_config),
                describe_speculation(agreement.speculative_config),
            )
        self._refused_speculation = refused
