"""Runs one benchmark: builds the workload, warms up, sends on schedule, computes the figures.

The main stream follows the arrival process (--request-rate, --burstiness); --max-concurrency
holds a request back until one of the main stream's requests in flight has ended, so a request
that waits for a slot is sent late, not early, and its latency is measured from when it is
actually sent. The mixed dataset's long requests come on a clock of their own, outside that
limit (they stand for other users), from the start of the run until the main stream is done.

Every request sent after the warm-ups ends up as exactly one record, failed or not. The
server's Prometheus counters are read right before the first request and after the last one
(`server_metrics.py`): speculative decoding's acceptance over exactly the measured requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import aiohttp

from nori.bench.serve.arrivals import arrival_times
from nori.bench.serve.client import RequestOptions, first_model, send_request
from nori.bench.serve.datasets import build_workload
from nori.bench.serve.figures import compute_metrics
from nori.bench.serve.records import RequestRecord
from nori.bench.serve.result import ServeBenchResult
from nori.bench.serve.server_metrics import scrape, spec_decode_figures
from nori.bench.serve.settings import ServeBenchSettings
from nori.bench.serve.specs import RequestSpec, Workload
from nori.models.demo import resolve_model
from nori.sampling.tokenizer import Tokenizer

logger = logging.getLogger("nori.bench.serve")

MIXED_CLASSES = ("short", "long")
# Seed streams of the two arrival clocks.
_MAIN_CLOCK = 0
_LONG_CLOCK = 1


def main_clock(settings: ServeBenchSettings) -> Iterator[float]:
    """Send times of the main stream, from the start of the run."""
    return arrival_times(settings.request_rate, settings.burstiness, (settings.seed, _MAIN_CLOCK))


def long_clock(settings: ServeBenchSettings) -> Iterator[float]:
    """Send times of the mixed dataset's long requests: Poisson, on a seed stream of their own."""
    return arrival_times(settings.long_request_rate, 1.0, (settings.seed, _LONG_CLOCK))


def load_tokenizer(name: str) -> Tokenizer:
    """A model folder's tokenizer, or "demo" for the demo checkpoint's."""
    return Tokenizer.from_dir(resolve_model(name))


async def run_benchmark(
    settings: ServeBenchSettings,
    *,
    tokenizer: Tokenizer | None = None,
    show_progress: bool = False,
) -> ServeBenchResult:
    """One run against `settings.base_url`. `tokenizer` overrides the one the settings name."""
    # No connection limit: --max-concurrency is the only one, as in vLLM (aiohttp's default pool
    # of 100 would queue requests inside the client and count the wait as TTFT). Each request
    # bounds itself with --request-timeout-s. Lines of up to 1 MiB (a usage or logprobs chunk).
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None),
        read_bufsize=1 << 20,
    ) as client:
        model = settings.model or await first_model(client, settings.base_url)
        if tokenizer is None:
            tokenizer = load_tokenizer(settings.tokenizer_for(model))
        workload = build_workload(settings, tokenizer)
        options = RequestOptions.from_settings(settings, model)
        await _warm_up(client, workload.warmups, options, settings.max_concurrency)
        first_long = workload.background(0) if workload.background is not None else None
        metrics_before = await scrape(client, settings.server_metrics_urls)
        date = datetime.now(UTC).isoformat(timespec="seconds")
        run = _Run(client, options, settings, time.perf_counter(), itertools.count())
        records = await run.execute(workload, first_long, show_progress)
        duration = time.perf_counter() - run.origin
        metrics_after = await scrape(client, settings.server_metrics_urls)
    slos = (settings.slo_ttft_ms, settings.slo_tpot_ms)
    class_metrics = {}
    if settings.dataset == "mixed":
        class_metrics = {
            name: compute_metrics([r for r in records if r.request_class == name], duration, *slos)
            for name in MIXED_CLASSES
        }
    return ServeBenchResult(
        settings=settings,
        model=model,
        metrics=compute_metrics(records, duration, *slos),
        records=tuple(records),
        class_metrics=class_metrics,
        date=date,
        spec_decode=spec_decode_figures(metrics_before, metrics_after),
    )


def run_benchmark_sync(
    settings: ServeBenchSettings,
    *,
    tokenizer: Tokenizer | None = None,
    show_progress: bool = False,
) -> ServeBenchResult:
    """`run_benchmark` for callers without an event loop."""
    return asyncio.run(run_benchmark(settings, tokenizer=tokenizer, show_progress=show_progress))


async def _warm_up(
    client: aiohttp.ClientSession,
    specs: tuple[RequestSpec, ...],
    options: RequestOptions,
    max_concurrency: int | None,
) -> None:
    if not specs:
        return
    limit = asyncio.Semaphore(max_concurrency or len(specs))

    async def one(spec: RequestSpec) -> RequestRecord:
        async with limit:
            return await send_request(client, spec, options, -1, time.perf_counter())

    records = await asyncio.gather(*(one(spec) for spec in specs))
    for record in records:
        if not record.success:
            logger.warning("a warm-up request failed: %s", record.error)


@dataclass(frozen=True)
class _Run:
    client: aiohttp.ClientSession
    options: RequestOptions
    settings: ServeBenchSettings
    # perf_counter() at the start; records hold times relative to it.
    origin: float
    # Record indices, in sending order across both clocks.
    indices: Iterator[int]

    def elapsed(self) -> float:
        return time.perf_counter() - self.origin

    async def execute(
        self, workload: Workload, first_long: RequestSpec | None, show_progress: bool
    ) -> list[RequestRecord]:
        """`first_long`: the mixed dataset's first long request, built before the clock
        started, since it is due at time zero."""
        from tqdm import tqdm

        main_done = asyncio.Event()
        background = None
        if workload.background is not None:
            background = asyncio.create_task(
                self._background(workload.background, first_long, main_done)
            )
        total = None if self.settings.duration_s is not None else len(workload.requests)
        with tqdm(
            total=total, unit="req", file=sys.stderr, disable=not show_progress, leave=False
        ) as progress:
            try:
                records = await self._main(workload.requests, progress.update)
            except BaseException:
                if background is not None:
                    background.cancel()
                raise
            finally:
                main_done.set()
            if background is not None:
                records += await background
        return sorted(records, key=lambda record: record.index)

    async def _main(
        self, requests: tuple[RequestSpec, ...], on_done: Callable[[int], object]
    ) -> list[RequestRecord]:
        settings = self.settings
        deadline = settings.duration_s
        limit = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
        specs = itertools.cycle(requests) if deadline is not None else iter(requests)
        times = main_clock(settings)
        tasks = []
        for spec, send_at in zip(specs, times, strict=False):
            if deadline is not None and send_at >= deadline:
                break
            delay = send_at - self.elapsed()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is not None:
                await limit.acquire()
            if deadline is not None and self.elapsed() >= deadline:
                if limit is not None:
                    limit.release()
                break
            tasks.append(asyncio.create_task(self._send(spec, limit, on_done)))
        return list(await asyncio.gather(*tasks))

    async def _send(
        self,
        spec: RequestSpec,
        limit: asyncio.Semaphore | None,
        on_done: Callable[[int], object],
    ) -> RequestRecord:
        try:
            record = await send_request(
                self.client, spec, self.options, next(self.indices), self.origin
            )
        finally:
            if limit is not None:
                limit.release()
        on_done(1)
        return record

    async def _background(
        self,
        make: Callable[[int], RequestSpec],
        first: RequestSpec | None,
        main_done: asyncio.Event,
    ) -> list[RequestRecord]:
        """Long requests on their own Poisson clock until the main stream is done."""
        times = long_clock(self.settings)
        tasks = []
        spec = first if first is not None else make(0)
        for number, send_at in enumerate(times):
            delay = send_at - self.elapsed()
            if delay > 0:
                # Stops waiting as soon as the main stream is done.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(main_done.wait(), delay)
            if main_done.is_set():
                break
            index = next(self.indices)
            tasks.append(
                asyncio.create_task(
                    send_request(self.client, spec, self.options, index, self.origin)
                )
            )
            # The next one is built now, during the gap, and off the event loop: tokenizing a
            # long prompt there would delay reading the streams and skew their timings.
            spec = await asyncio.to_thread(make, number + 1)
        return list(await asyncio.gather(*tasks))
