"""Prometheus figures of one worker, served on its own /metrics (`--metrics-port`).

Counters and histograms are updated by each request's `CallRecord` (`request_telemetry.py`);
gauges come from the engine's last load snapshot at scrape time, in a registry per worker."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nori.engine.engine import LLMEngine
from nori.engine.outputs import (
    EngineLoad,
    ExpertRoutingCounts,
    SpecDecodeCounts,
    expert_imbalance,
)

if TYPE_CHECKING:
    from nori.worker.engine_core import EngineCore

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
TRANSFER_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
GBPS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 400)

# The `outcome` label; "transferred": handed on to a decode worker.
OUTCOMES = ("stop", "length", "transferred", "abort", "error")

# nori_moe_expert_imbalance's window: tokens routed since the latest scrape at least this old.
IMBALANCE_WINDOW_S = 60.0
# How long a scrape waits for the engine loop's expert counts; past it, the last counts read.
EXPERT_COUNTS_WAIT_S = 5.0


class _EngineStateCollector(Collector):
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
    """vLLM's spec_decode counters under Nori's prefix (always there), and two ratios over the
    worker's life, omitted until the first draft (NaN poisons sums across workers)."""
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


class _ExpertLoadCollector(Collector):
    """A mixture-of-experts model's load balance, read at scrape time; nothing for a dense model.

    `nori_moe_expert_tokens_total{layer, expert}` counts tokens routed since the engine loaded;
    `nori_moe_expert_imbalance{layer}` is max/mean tokens per expert over the tokens routed since
    the latest scrape at least IMBALANCE_WINDOW_S old (no sample for a layer that routed none)."""

    def __init__(
        self,
        counts: Callable[[], ExpertRoutingCounts | None],
        window_s: float = IMBALANCE_WINDOW_S,
    ) -> None:
        self._counts = counts
        self._window_s = window_s
        self._history: deque[tuple[float, ExpertRoutingCounts]] = deque()
        self._lock = threading.Lock()  # scrapes may overlap (one thread per HTTP request)

    def describe(self) -> list[Metric]:
        """The names, without asking the engine (registering must not wait for a step)."""
        return [
            CounterMetricFamily("nori_moe_expert_tokens", "", labels=["layer", "expert"]),
            GaugeMetricFamily("nori_moe_expert_imbalance", "", labels=["layer"]),
        ]

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        if counts is None:
            return
        window = self._window(counts)
        tokens = CounterMetricFamily(
            "nori_moe_expert_tokens",
            "Tokens routed to each expert of each routed layer (each token counts in each of "
            "its top-k experts).",
            labels=["layer", "expert"],
        )
        for layer, layer_counts in counts.layers:
            for expert, num_tokens in enumerate(layer_counts):
                tokens.add_metric([str(layer), str(expert)], num_tokens)
        yield tokens
        imbalance = GaugeMetricFamily(
            "nori_moe_expert_imbalance",
            f"Busiest expert's tokens over the mean per expert (1.0 = even), over the tokens "
            f"routed in about the last {self._window_s:g} s (since the latest scrape at least "
            "that old).",
            labels=["layer"],
        )
        for layer, layer_counts in window.layers:
            ratio = expert_imbalance(layer_counts)
            if ratio is not None:
                imbalance.add_metric([str(layer)], ratio)
        yield imbalance

    def _window(self, counts: ExpertRoutingCounts) -> ExpertRoutingCounts:
        now = time.monotonic()
        with self._lock:
            history = self._history
            while len(history) >= 2 and now - history[1][0] >= self._window_s:
                history.popleft()
            start = history[0][1] if history else None
            history.append((now, counts))
        if start is None or [layer for layer, _ in start.layers] != [
            layer for layer, _ in counts.layers
        ]:
            return counts
        return counts.since(start)


class EngineExpertCounts:
    """`LLMEngine.expert_routing_counts` of a worker's engine core for a scrape on another thread,
    waited for up to `wait_s`; past it, or on the event loop's thread, the last counts read."""

    def __init__(
        self,
        core: EngineCore,
        loop: asyncio.AbstractEventLoop,
        wait_s: float = EXPERT_COUNTS_WAIT_S,
    ) -> None:
        self._core = core
        self._loop = loop
        self._wait_s = wait_s
        self._dense = False
        self._last: ExpertRoutingCounts | None = None

    def __call__(self) -> ExpertRoutingCounts | None:
        if self._dense or _on_loop(self._loop):
            return self._last
        future = asyncio.run_coroutine_threadsafe(
            self._core.call(LLMEngine.expert_routing_counts), self._loop
        )
        try:
            counts = future.result(self._wait_s)
        except FutureTimeout:
            future.cancel()
            logger.warning("expert counts: no answer from the engine in %.1f s", self._wait_s)
            return self._last
        except Exception:
            logger.warning("expert counts: reading them failed", exc_info=True)
            return self._last
        if counts is None:
            self._dense = True
        self._last = counts
        return counts


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


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
        self.kv_received_bytes = Counter(
            "nori_kv_received_bytes",
            "KV bytes received, by how they came: messages, or copied out of the receiver's "
            "mapping of the sender's shared memory (mapped).",
            ["bulk"],
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

    def watch_experts(
        self,
        counts: Callable[[], ExpertRoutingCounts | None],
        window_s: float = IMBALANCE_WINDOW_S,
    ) -> None:
        """Registers the load-balance figures of a MoE model (`counts`, e.g. EngineExpertCounts);
        a dense model's None leaves them out."""
        self.registry.register(_ExpertLoadCollector(counts, window_s))

    def token_totals(self) -> tuple[float, float]:
        """Prompt tokens taken and generated since the start, read from the two counters (the
        registry would also ask the engine for its expert counts)."""
        return _counter_total(self.prompt_tokens), _counter_total(self.generation_tokens)

    def serve(self, host: str, port: int) -> tuple[WSGIServer, int]:
        """Serves /metrics on a thread of its own; port 0 picks a free one (returned)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, int(server.server_port)


def _counter_total(counter: Counter) -> float:
    return next(
        sample.value
        for family in counter.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    )
