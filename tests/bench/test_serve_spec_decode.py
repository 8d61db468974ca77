"""Speculative decoding's acceptance in `nori bench serve`: the figures from two scrapes of the
servers' Prometheus text (a Nori gateway's, a worker's, vLLM's), their absence when nothing was
speculated, and a whole run against a fake server that exposes the counters."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from aiohttp import web
from prometheus_client import generate_latest

from nori.bench.serve.report import format_report
from nori.bench.serve.runner import run_benchmark
from nori.bench.serve.server_metrics import (
    SpecDecodeTotals,
    spec_decode_figures,
    spec_decode_totals,
)
from nori.bench.serve.settings import ServeBenchSettings
from nori.engine.outputs import EngineLoad, SpecDecodeCounts
from nori.gateway.server import worker_metrics_text
from nori.sampling.tokenizer import Tokenizer
from nori.v1 import common_pb2
from nori.worker.worker_metrics import WorkerMetrics
from tests.bench.fake_server import FakeOpenAI, serving


def _gateway_text(*workers: tuple[int, int, int]) -> str:
    """A gateway's worker figures, one (drafts, draft tokens, accepted) per decode worker, and
    a prefill worker that never speculates."""
    stats = [common_pb2.WorkerStats(worker_id="p0", role="prefill", num_requests=5)]
    for index, (drafts, proposed, accepted) in enumerate(workers):
        stats.append(
            common_pb2.WorkerStats(
                worker_id=f"d{index}",
                role="decode",
                spec_decode_num_drafts=drafts,
                spec_decode_num_draft_tokens=proposed,
                spec_decode_num_accepted_tokens=accepted,
            )
        )
    return worker_metrics_text(stats)


def _worker_text(drafts: int, proposed: int, accepted: int) -> str:
    """A worker's own /metrics for an engine with these counters."""
    metrics = WorkerMetrics()
    counts = SpecDecodeCounts(drafts, proposed, accepted)
    metrics.watch_engine(lambda: EngineLoad(spec_decode=counts), lambda: 0)
    return generate_latest(metrics.registry).decode()


def test_the_gateway_text_sums_the_workers_and_the_run_is_the_difference() -> None:
    before = _gateway_text((100, 300, 150), (40, 120, 60))
    assert spec_decode_totals(before) == SpecDecodeTotals(140, 420, 210)
    after = _gateway_text((130, 390, 222), (50, 150, 70))
    figures = spec_decode_figures([before], [after])
    assert figures is not None
    # During the run: 40 verifications, 120 draft tokens, 82 accepted.
    assert (figures.num_drafts, figures.num_draft_tokens, figures.num_accepted_tokens) == (
        40,
        120,
        82,
    )
    assert figures.acceptance_rate == pytest.approx(82 / 120)
    assert figures.mean_accepted_length == pytest.approx(1 + 82 / 40)
    assert figures.as_dict()["spec_decode_mean_accepted_length"] == pytest.approx(3.05)


def test_workers_scraped_one_by_one_add_up() -> None:
    before = [_worker_text(10, 40, 20), _worker_text(0, 0, 0)]
    after = [_worker_text(20, 80, 50), _worker_text(5, 20, 5)]
    figures = spec_decode_figures(before, after)
    assert figures is not None
    assert (figures.num_drafts, figures.num_draft_tokens, figures.num_accepted_tokens) == (
        15,
        60,
        35,
    )
    assert figures.mean_accepted_length == pytest.approx(1 + 35 / 15)


def test_vllm_counters_read_the_same() -> None:
    def vllm_text(drafts: int, proposed: int, accepted: int) -> str:
        lines = []
        for name, value in (
            ("num_drafts", drafts),
            ("num_draft_tokens", proposed),
            ("num_accepted_tokens", accepted),
        ):
            lines += [
                f"# TYPE vllm:spec_decode_{name} counter",
                f'vllm:spec_decode_{name}_total{{engine="0",model_name="m"}} {value}.0',
            ]
        return "\n".join(lines) + "\n"

    figures = spec_decode_figures([vllm_text(2, 8, 4)], [vllm_text(12, 48, 34)])
    assert figures is not None
    assert figures.acceptance_rate == pytest.approx(30 / 40)
    assert figures.mean_accepted_length == pytest.approx(4.0)


def test_no_figures_without_speculation_or_counters() -> None:
    idle = _gateway_text((7, 21, 9))
    # A Nori server that did not speculate during the run: the counters stood still.
    assert spec_decode_figures([idle], [idle]) is None
    assert spec_decode_figures([_worker_text(0, 0, 0)], [_worker_text(0, 0, 0)]) is None
    # A server without the counters, an endpoint that did not answer, a worker that restarted.
    other = "# TYPE some_total counter\nsome_total 3.0\n"
    assert spec_decode_totals(other) is None
    assert spec_decode_figures([other], [other]) is None
    assert spec_decode_figures([None], [idle]) is None
    assert spec_decode_figures([idle], [_gateway_text((1, 3, 1))]) is None


class _SpeculatingServer(FakeOpenAI):
    """The fake server with a /metrics whose counters grow with each request served: 2
    verifications per request, 3 drafts each, 4 of the 6 accepted."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/metrics":
            served = len(self.bodies)
            return web.Response(text=_gateway_text((2 * served, 6 * served, 4 * served)))
        return await super().handle(request)


async def test_a_run_reports_the_acceptance_of_its_own_requests(tokenizer: Tokenizer) -> None:
    settings = ServeBenchSettings(
        num_prompts=5,
        num_warmups=2,
        random_input_len=8,
        random_output_len=3,
        prompt_format="token-ids",
    )
    fake = _SpeculatingServer()
    async with fake.serving() as url:
        result = await run_benchmark(replace(settings, base_url=url), tokenizer=tokenizer)
    # The warm-ups' drafts are not the run's.
    assert result.spec_decode is not None and result.spec_decode.num_drafts == 2 * 5
    assert result.spec_decode.acceptance_rate == pytest.approx(4 / 6)
    figures = json.loads(json.dumps(result.to_dict()))
    assert figures["spec_decode_num_draft_tokens"] == 6 * 5
    assert figures["spec_decode_mean_accepted_length"] == pytest.approx(1 + 4 * 5 / 10)
    report = format_report(result)
    assert "Speculative Decoding" in report and "66.67" in report

    # A server whose /metrics fails (the plain fake answers it 500): no figures, no error.
    async with FakeOpenAI().serving() as url:
        plain = await run_benchmark(replace(settings, base_url=url), tokenizer=tokenizer)
    assert plain.spec_decode is None and plain.metrics.completed == 5
    assert "spec_decode_acceptance_rate" not in plain.to_dict()
    assert "Speculative" not in format_report(plain)


async def test_metrics_urls_name_the_endpoints_to_read(tokenizer: Tokenizer) -> None:
    scrapes = []

    async def worker(request: web.Request) -> web.StreamResponse:
        scrapes.append(request.path)
        n = len(scrapes)
        return web.Response(text=_worker_text(3 * n, 9 * n, 6 * n))

    settings = ServeBenchSettings(
        num_prompts=2, random_input_len=8, random_output_len=2, prompt_format="token-ids"
    )
    assert settings.server_metrics_urls == ("http://127.0.0.1:8000/metrics",)
    async with FakeOpenAI().serving() as url, serving(worker) as worker_url:
        chosen = replace(settings, base_url=url, metrics_urls=(f"{worker_url}/metrics",))
        result = await run_benchmark(chosen, tokenizer=tokenizer)
    # Read before and after the run, and only there (the fake gateway's /metrics fails).
    assert scrapes == ["/metrics", "/metrics"]
    assert result.spec_decode is not None and result.spec_decode.num_drafts == 3
    assert result.spec_decode.mean_accepted_length == pytest.approx(3.0)
