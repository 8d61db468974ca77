"""Prometheus figures of one worker, served on its own /metrics (`--metrics-port`).

Counters and histograms are updated as requests pass (`request_telemetry.py`); the state gauges
(running and waiting requests, KV blocks, transfers in flight) and the engine's own counters
(preemptions, prompt positions computed, speculative decoding's drafts and accepted tokens) are
read from the engine's last load snapshot when Prometheus scrapes, so the engine thread does no
extra work for them. A registry of its own per worker (not prometheus_client's global default)
lets one process hold several workers, as the tests do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nori.engine.outputs import EngineLoad, SpecDecodeCounts

# From a cached one-token answer (milliseconds) to a long generation (minutes).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
# Between two tokens of one stream: a step takes milliseconds; a stall shows in the high buckets.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
TRANSFER_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
GBPS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 400)

# Request outcomes on a worker (the `outcome` label): how the engine finished it ("stop",
# "length"), handed on to a decode worker ("transferred"), ended by its caller ("abort"),
# or failed here ("error").
OUTCOMES = ("stop", "length", "transferred", "abort", "error")


class _EngineStateCollector(Collector):
    """The gauges that describe the engine now, read at scrape time."""

    def __init__(self, load: Callable[[], EngineLoad], transfers_in_flight: Callable[[], int]):
        self._load = load
        self._transfers_in_flight = transfers_in_flight

    def collect(self) -> Iterator[Metric]:
        load = self._load()
        used = load.num_total_blocks - load.num_free_blocks
        for name, documentation, value in (
            ("nori_num_requests_running", "Requests in the running batch.", load.num_running),
            ("nori_num_requests_waiting", "Requests waiting to be scheduled.", load.num_waiting),
            ("nori_kv_blocks_free", "KV blocks an allocation can take now.", load.num_free_blocks),
            ("nori_kv_blocks_used", "KV blocks held by requests.", used),
            ("nori_kv_blocks_total", "KV blocks in the pool.", load.num_total_blocks),
            (
                "nori_kv_blocks_cached",
                "KV blocks whose content is in the prefix cache (in use or evictable).",
                load.num_cached_blocks,
            ),
            (
                "nori_kv_transfers_in_flight",
                "KV transfers this worker is sending or receiving now.",
                self._transfers_in_flight(),
            ),
        ):
            yield GaugeMetricFamily(name, documentation, value=value)
        yield CounterMetricFamily(
            "nori_num_preemptions",
            "Requests preempted (blocks taken back, to be recomputed).",
            value=load.num_preemptions,
        )
        yield CounterMetricFamily(
            "nori_prompt_tokens_computed",
            "Prompt positions this engine computed itself (not found in the prefix cache, not "
            "received with their KV from another worker; recomputes count again).",
            value=load.num_prompt_tokens_computed,
        )
        yield from _spec_decode_families(load.spec_decode)


def _spec_decode_families(counts: SpecDecodeCounts) -> Iterator[Metric]:
    """vLLM's spec_decode counters under Nori's prefix, and two ratios over the worker's life.

    The counters are always there (zero without speculation), so that `rate()` works from the
    first scrape. The ratios are omitted until the first draft, rather than written as NaN or
    0: either would read as a measurement, and NaN poisons sums and averages across workers.
    Over a time window, divide the counters' increases instead (what `nori bench serve` does).
    """
    for name, documentation, value in (
        (
            "nori_spec_decode_num_drafts",
            "Speculative verifications: requests x steps that carried draft tokens (each also "
            "yields one bonus token).",
            counts.num_drafts,
        ),
        (
            "nori_spec_decode_num_draft_tokens",
            "Draft tokens proposed and verified.",
            counts.num_draft_tokens,
        ),
        (
            "nori_spec_decode_num_accepted_tokens",
            "Draft tokens the model accepted.",
            counts.num_accepted_tokens,
        ),
        (
            "nori_spec_decode_num_bonus_tokens",
            "Tokens sampled from the model after a verification's accepted drafts (one per "
            "verification).",
            counts.num_bonus_tokens,
        ),
    ):
        yield CounterMetricFamily(name, documentation, value=value)
    if counts.acceptance_rate is not None:
        yield GaugeMetricFamily(
            "nori_spec_decode_acceptance_rate",
            "Accepted / proposed draft tokens since the start (absent before the first draft).",
            value=counts.acceptance_rate,
        )
    if counts.mean_accepted_length is not None:
        yield GaugeMetricFamily(
            "nori_spec_decode_mean_accepted_length",
            "Tokens a verification yields on average since the start: 1 + accepted drafts per "
            "verification (absent before the first draft).",
            value=counts.mean_accepted_length,
        )


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "nori_requests",
            "Requests that ended on this worker, by outcome.",
            ["outcome"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "nori_prompt_tokens", "Prompt tokens of requests taken.", registry=registry
        )
        self.generation_tokens = Counter(
            "nori_generation_tokens", "Tokens generated here.", registry=registry
        )
        self.prefix_cache_queries = Counter(
            "nori_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (hit rate: hits / queries).",
            registry=registry,
        )
        self.prefix_cache_hits = Counter(
            "nori_prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=registry
        )
        self.time_to_first_token = Histogram(
            "nori_time_to_first_token_seconds",
            "From the call's arrival to its first token from this worker's engine (a decode "
            "worker: to the first token it generates after the transfer).",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "nori_inter_token_latency_seconds",
            "Between consecutive tokens of one stream (a delta of k tokens counts k times, each "
            "a k-th of the gap).",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e_latency = Histogram(
            "nori_e2e_request_latency_seconds",
            "From the call's arrival to its end on this worker.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_time = Histogram(
            "nori_request_queue_time_seconds",
            "From entering the engine's queue to its first step (a decode worker: after the "
            "KV arrived).",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.kv_transfer_bytes = Counter(
            "nori_kv_transfer_bytes", "KV bytes sent or received.", registry=registry
        )
        self.kv_transfer_draft_bytes = Counter(
            "nori_kv_transfer_draft_bytes",
            "Of the KV bytes sent or received, a draft model's (speculative decoding).",
            registry=registry,
        )
        self.kv_transfer_seconds = Histogram(
            "nori_kv_transfer_duration_seconds",
            "One request's KV transfer, first byte to last.",
            buckets=TRANSFER_SECONDS_BUCKETS,
            registry=registry,
        )
        self.kv_transfer_gbps = Histogram(
            "nori_kv_transfer_gigabytes_per_second",
            "One request's KV transfer rate (GB/s).",
            buckets=GBPS_BUCKETS,
            registry=registry,
        )
        self.lease_expiries = Counter(
            "nori_kv_lease_expiries",
            "Reservations whose KV never arrived (lease or transfer timeout).",
            registry=registry,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # present (at 0) before the first request ends

    def watch_engine(
        self, load: Callable[[], EngineLoad], transfers_in_flight: Callable[[], int]
    ) -> None:
        self.registry.register(_EngineStateCollector(load, transfers_in_flight))

    def token_totals(self) -> tuple[float, float]:
        """Prompt tokens taken and tokens generated since the start (for the load line)."""
        value = self.registry.get_sample_value
        return (
            value("nori_prompt_tokens_total") or 0.0,
            value("nori_generation_tokens_total") or 0.0,
        )

    def observe_transfer(self, nbytes: int, seconds: float, draft_nbytes: int = 0) -> None:
        """A hand-off's bytes (`draft_nbytes` of them a draft model's K/V) and time."""
        self.kv_transfer_bytes.inc(nbytes)
        self.kv_transfer_draft_bytes.inc(draft_nbytes)
        self.kv_transfer_seconds.observe(seconds)
        if seconds > 0:
            self.kv_transfer_gbps.observe(nbytes / seconds / 1e9)

    def serve(self, host: str, port: int) -> tuple[WSGIServer, int]:
        """Serves /metrics on a thread of its own; port 0 picks a free one (returned)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, int(server.server_port)
