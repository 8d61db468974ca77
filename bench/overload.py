"""`nori bench overload`: offer a cluster several times what it can serve, and judge how it copes.

First a closed-loop run (`--calibrate-s` at `--calibrate-concurrency`) measures the cluster's
capacity in requests per second. Then Poisson arrivals at `--factor` times that rate for
`--seconds`, open loop: nobody waits for a free slot, as with real users. A server that copes
sheds what it cannot serve (429 with Retry-After, at once) and keeps the requests it admits fast.

Verdicts, as issue 11 states them: no role crashed, the excess was refused with 429 and every
429 said when to retry, nothing else failed, the admitted requests' TTFT p99 stayed under
`--max-ttft-p99-s`, each role's peak RSS grew under 10% over its warm size, and every worker's
free KV blocks came back once the cluster was idle.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nori.bench.cluster_probe import (
    BenchCluster,
    idle_free_blocks,
    rss_bytes,
    start_bench_cluster,
    worker_metrics_addresses,
)
from nori.bench.serve.records import RequestRecord
from nori.bench.serve.runner import run_benchmark_sync
from nori.bench.serve.settings import ServeBenchSettings
from nori.launch.local_cluster import LocalCluster
from nori.models.demo import resolve_model
from nori.sampling.tokenizer import Tokenizer

MAX_RSS_GROWTH = 0.10
_STATUS = re.compile(r"^HTTP (\d{3})")


@dataclass(frozen=True)
class OverloadSettings:
    factor: float = 5.0
    seconds: float = 60.0
    calibrate_s: float = 20.0
    calibrate_concurrency: int = 16
    # The bound the admitted requests' TTFT p99 is judged against.
    max_ttft_p99_s: float = 10.0
    model: str = "demo"
    num_prefill: int = 1
    num_decode: int = 1
    colocated: bool = False
    workload: ServeBenchSettings = field(
        default_factory=lambda: ServeBenchSettings(
            dataset="random",
            random_input_len=128,
            random_output_len=128,
            prompt_format="token-ids",
            ignore_eos=True,
            num_prompts=100_000,
            num_warmups=0,
        )
    )
    worker_args: tuple[str, ...] = ()
    log_dir: Path | None = None
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.seconds <= 0 or self.calibrate_s <= 0:
            raise ValueError("--factor, --seconds and --calibrate-s must be positive")


class PeakRss:
    """Each process's highest RSS, sampled every `interval_s` on a thread while in a `with`."""

    def __init__(self, cluster: LocalCluster, interval_s: float = 0.5) -> None:
        self._cluster = cluster
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.peak_mib: dict[str, float] = {}

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            for role in self._cluster.processes:
                mib = rss_bytes(role.process.pid) / 2**20
                self.peak_mib[role.name] = max(self.peak_mib.get(role.name, 0.0), mib)
            if self._stop.wait(self._interval_s):
                return


def outcome_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Requests by outcome: "ok", an HTTP status ("429"), or "other" (a broken stream, a
    timeout); and "429_with_retry_after"."""
    counts: Counter[str] = Counter()
    for record in records:
        if record.success:
            counts["ok"] += 1
            continue
        match = _STATUS.match(record.error or "")
        status = match.group(1) if match else "other"
        counts[status] += 1
        if status == "429" and "[Retry-After: " in (record.error or ""):
            counts["429_with_retry_after"] += 1
    return dict(counts)


def run_overload(settings: OverloadSettings, log: Callable[[str], None]) -> dict[str, Any]:
    model_dir = resolve_model(settings.model)
    tokenizer = Tokenizer.from_dir(model_dir)
    with ExitStack() as stack:
        cluster = start_bench_cluster(
            stack,
            BenchCluster(
                model_dir=model_dir,
                num_prefill=settings.num_prefill,
                num_decode=settings.num_decode,
                colocated=settings.colocated,
                worker_args=settings.worker_args,
                log_dir=settings.log_dir,
                startup_timeout_s=settings.startup_timeout_s,
                name="overload",
            ),
        )
        addresses = worker_metrics_addresses(cluster)
        start_free = idle_free_blocks(addresses)
        base = replace(
            settings.workload, base_url=cluster.url, model=model_dir.name, tokenizer=str(model_dir)
        )
        calibration = run_benchmark_sync(
            replace(
                base,
                duration_s=settings.calibrate_s,
                max_concurrency=settings.calibrate_concurrency,
            ),
            tokenizer=tokenizer,
        ).metrics
        capacity = calibration.request_throughput
        if calibration.failed or not capacity:
            raise RuntimeError(
                f"the calibration run failed {calibration.failed} of "
                f"{calibration.completed + calibration.failed} requests; see the logs"
            )
        warm_mib = {p.name: rss_bytes(p.process.pid) / 2**20 for p in cluster.processes}
        rate = settings.factor * capacity
        log(f"capacity {capacity:.2f} requests/s; offering {rate:.2f}/s for {settings.seconds:g} s")
        with PeakRss(cluster) as peak:
            result = run_benchmark_sync(
                replace(
                    base,
                    duration_s=settings.seconds,
                    request_rate=rate,
                    max_concurrency=None,
                    seed=base.seed + 1,  # other prompts than the calibration's
                ),
                tokenizer=tokenizer,
            )
        cluster.check_alive()
        end_free = idle_free_blocks(addresses)
        cluster.check_alive()
        log("stopping the cluster...")
    return overload_report(
        settings,
        capacity,
        rate,
        result.metrics.as_dict(),
        outcome_counts(result.records),
        warm_mib,
        peak.peak_mib,
        {name: start_free[name] - end_free.get(name, 0) for name in start_free},
    )


def overload_report(
    settings: OverloadSettings,
    capacity: float,
    rate: float,
    admitted: dict[str, Any],
    outcomes: dict[str, int],
    warm_mib: dict[str, float],
    peak_mib: dict[str, float],
    leaked_blocks: dict[str, int],
) -> dict[str, Any]:
    """The verdicts (pure: unit-tested on fixed figures). `admitted`: the run's serve metrics,
    whose latencies are over the successful requests only."""
    rss_growth = {
        name: (peak_mib.get(name, mib) - mib) / mib if mib else 0.0
        for name, mib in warm_mib.items()
    }
    refused = outcomes.get("429", 0)
    other_failures = sum(
        count for key, count in outcomes.items() if key not in ("ok", "429", "429_with_retry_after")
    )
    ttft_p99_s = float(admitted.get("p99_ttft_ms") or 0.0) / 1000
    return {
        "factor": settings.factor,
        "seconds": settings.seconds,
        "capacity_request_rate": capacity,
        "offered_request_rate": rate,
        "outcomes": outcomes,
        "admitted_share": outcomes.get("ok", 0)
        / max(1, sum(count for key, count in outcomes.items() if key != "429_with_retry_after")),
        "admitted_output_throughput": admitted.get("output_throughput"),
        "admitted_median_ttft_ms": admitted.get("median_ttft_ms"),
        "admitted_p99_ttft_ms": admitted.get("p99_ttft_ms"),
        "admitted_median_tpot_ms": admitted.get("median_tpot_ms"),
        "admitted_p99_itl_ms": admitted.get("p99_itl_ms"),
        "warm_rss_mib": warm_mib,
        "peak_rss_mib": peak_mib,
        "rss_growth": rss_growth,
        "leaked_blocks": leaked_blocks,
        "ok": {
            "shed_with_429": refused > 0 and outcomes.get("429_with_retry_after", 0) == refused,
            "no_other_failures": other_failures == 0,
            "ttft_p99": 0 < ttft_p99_s <= settings.max_ttft_p99_s,
            "rss": all(growth < MAX_RSS_GROWTH for growth in rss_growth.values()),
            "blocks": not any(leaked_blocks.values()),
        },
    }
