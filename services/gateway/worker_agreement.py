"""What every worker of a cluster must share with the others, and which workers do not (pure
logic over registry entries; `WorkerPool` routes only to the members and logs the refused).

KV blocks move between workers as stored, so all agree on the KV layout (block size, cache
dtype), and they run the same speculative decoding (the decode side goes on from what the
prefill side computed, a draft model's state included). The cluster's settings are its
longest-running worker's, so that a newcomer with other flags is refused, not obeyed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nori.state.registry import WorkerInfo


@dataclass(frozen=True)
class KVLayoutAgreement:
    """The cluster's KV layout (block size, cache dtype), the workers that use it and the rest."""

    block_size: int | None
    kv_cache_dtype: str | None
    members: list[WorkerInfo]
    refused: list[WorkerInfo]


def agree_on_kv_layout(workers: Sequence[WorkerInfo], expected: int | None) -> KVLayoutAgreement:
    """The block size `expected` when given; else, as the KV cache dtype, what the
    longest-running worker states. A worker that states neither (0 / "": an older version)
    is taken to match."""
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
