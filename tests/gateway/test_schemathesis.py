"""Schemathesis against a real cluster: over a thousand bodies generated from the gateway's own
OpenAPI schema, hostile ones included, and none gets a 5xx or an error inside a 200 stream.

Two passes. The schema as served, valid and deliberately invalid bodies (schemathesis'
negative mode), on every operation: mostly refusals, which must all be 4xx. The same schema with
the limits the gateway checks in code written into it (`openapi_limits`), valid bodies only:
these pass the checks, so at least one case in ten is a completion the workers computed. The
`model` field always names the served model, else every body would stop at the 404 for an
unknown model. Afterwards the gateway is healthy and still completes a plain request.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import Case, GenerationMode

from nori.launch.local_cluster import LocalCluster
from tests.cluster.conftest import WORKER_ARGS, start_cluster
from tests.gateway.openapi_limits import MAX_MODEL_LEN, with_enforced_limits

pytestmark = pytest.mark.slow

# Cases per operation and pass; operations without inputs (GET /health) have only one.
SERVED_VALID_CASES = 100
SERVED_INVALID_CASES = 60
LIMITED_CASES = 100
MIN_TOTAL_CASES = 1000
# Completion endpoints: a 200 there is a request the workers computed.
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def short_context_cluster(
    redis_url: str, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    # A 64-token context on the gateway and the workers: no generated body can run for long.
    running = start_cluster(
        redis_url,
        tiny_checkpoint,
        tmp_path_factory.mktemp("schemathesis-logs"),
        num_decode=1,
        max_model_len=MAX_MODEL_LEN,
        worker_args=(*WORKER_ARGS, "--max-model-len", str(MAX_MODEL_LEN)),
    )
    try:
        yield running
    finally:
        running.stop()


class Tally:
    """How many cases got which status, per operation."""

    def __init__(self) -> None:
        self.statuses: Counter[tuple[str, int]] = Counter()

    def record(self, case: Case, status: int) -> None:
        self.statuses[(f"{case.method} {case.path}", status)] += 1

    @property
    def total(self) -> int:
        return sum(self.statuses.values())

    @property
    def completed(self) -> int:
        return sum(
            count
            for (label, status), count in self.statuses.items()
            if status == 200 and label.endswith(COMPLETION_PATHS)
        )


def _stream_error(response: schemathesis.Response) -> str | None:
    """The error event of a 200 event stream, if any: a failure after the status was sent."""
    content_types = [
        v for k, vs in response.headers.items() if k.lower() == "content-type" for v in vs
    ]
    if not any(value.startswith("text/event-stream") for value in content_types):
        return None
    for line in response.text.splitlines():
        payload = line.removeprefix("data: ")
        if payload.startswith('{"error"'):
            return payload
    return None


def _whole_floats_as_ints(value: Any) -> Any:
    """`1.0` as `1`: JSON Schema counts 1.0 as an integer, and schemathesis sends such floats
    for integer fields, which the gateway's strict validation refuses (protocol.py)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_whole_floats_as_ints(item) for item in value]
    if isinstance(value, dict):
        return {key: _whole_floats_as_ints(item) for key, item in value.items()}
    return value


def _run_operation(
    operation: Any,
    mode: GenerationMode,
    max_examples: int,
    model: str,
    base_url: str,
    session: requests.Session,
    tally: Tally,
    ints_as_ints: bool,
) -> None:
    def with_served_model(case: Case) -> Case:
        # Else every body would stop at the 404 for an unknown model.
        if isinstance(case.body, dict):
            body = _whole_floats_as_ints(case.body) if ints_as_ints else case.body
            case.body = {**body, "model": model}
        return case

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        # No `explain` phase: it replays cases again against the cluster, for little.
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=(
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
            HealthCheck.data_too_large,
        ),
    )
    @given(case=operation.as_strategy(mode).map(with_served_model))
    def send(case: Case) -> None:
        response = case.call(base_url=base_url, session=session, timeout=60)
        tally.record(case, response.status_code)
        assert response.status_code < 500, (case.as_curl_command(), response.text[:2000])
        error = _stream_error(response) if response.status_code == 200 else None
        assert error is None, (case.as_curl_command(), error)

    send()


def _fuzz(
    schema: Any,
    modes: dict[GenerationMode, int],
    model: str,
    base_url: str,
    tally: Tally,
    ints_as_ints: bool = False,
) -> None:
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode, max_examples in modes.items():
                # Negative bodies only: a path or an empty input has no invalid form to send.
                if mode is GenerationMode.NEGATIVE and len(operation.body) == 0:
                    continue
                _run_operation(
                    operation, mode, max_examples, model, base_url, session, tally, ints_as_ints
                )


def test_generated_requests_get_no_server_error(short_context_cluster: LocalCluster) -> None:
    cluster = short_context_cluster
    model = httpx.get(f"{cluster.url}/v1/models").json()["data"][0]["id"]
    served = httpx.get(f"{cluster.url}/openapi.json").json()
    vocab_size = json.loads((Path(cluster.spec.model) / "config.json").read_text())["vocab_size"]
    tally = Tally()

    _fuzz(
        schemathesis.openapi.from_dict(served),
        {
            GenerationMode.POSITIVE: SERVED_VALID_CASES,
            GenerationMode.NEGATIVE: SERVED_INVALID_CASES,
        },
        model,
        cluster.url,
        tally,
    )
    limited = schemathesis.openapi.from_dict(with_enforced_limits(served, vocab_size))
    _fuzz(
        limited.include(method="POST"),
        {GenerationMode.POSITIVE: LIMITED_CASES},
        model,
        cluster.url,
        tally,
        ints_as_ints=True,
    )

    report = sorted(tally.statuses.items())
    print(f"{tally.total} cases, {tally.completed} completions computed: {report}")
    assert tally.total >= MIN_TOTAL_CASES, report
    assert tally.completed >= tally.total // 10, report

    cluster.check_alive()
    assert httpx.get(f"{cluster.url}/health").status_code == 200
    completion = httpx.post(
        f"{cluster.url}/v1/completions",
        json={"model": model, "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True},
        timeout=60,
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 4
