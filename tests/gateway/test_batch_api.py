"""The Files and Batch API routes in-process: the official `openai` client's calls, and the
errors bad input gets (413, 404, 400, 409), over a real Redis and a batch directory."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis

from nori.batch.jobs import BatchJobs
from nori.batch.store import BatchStore
from nori.gateway.batch_api import FILES_PATH, batch_routes
from nori.sampling.tokenizer import Tokenizer
from nori.state.keys import Keys
from tests.gateway.app_helpers import assert_error, client, make_app

MAX_FILE_BYTES = 4096


def _lines(num: int, url: str = "/v1/completions") -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": url,
                "body": {"model": "tiny-test", "prompt": "hi"},
            }
        ).encode()
        + b"\n"
        for i in range(num)
    )


@pytest.fixture
async def app(
    tokenizer: Tokenizer, tmp_path: Path, redis_url: str
) -> AsyncIterator[tuple[FastAPI, BatchStore]]:
    redis = Redis.from_url(redis_url)
    store = BatchStore(tmp_path / "batches")
    jobs = BatchJobs(redis, Keys(f"test-{uuid.uuid4().hex[:8]}"))
    yield (
        make_app(
            tokenizer,
            routers=[batch_routes(store, jobs)],
            path_body_limits={FILES_PATH: MAX_FILE_BYTES},
        ),
        store,
    )
    await redis.aclose()


async def test_the_openai_client_uploads_creates_lists_and_cancels(
    app: tuple[FastAPI, BatchStore],
) -> None:
    gateway, store = app
    http = client(gateway)
    api = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="x", http_client=http)
    uploaded = await api.files.create(file=("in.jsonl", _lines(3)), purpose="batch")
    assert uploaded.bytes == len(_lines(3)) and uploaded.purpose == "batch"
    assert (await api.files.retrieve(uploaded.id)).filename == "in.jsonl"
    assert (await api.files.content(uploaded.id)).content == _lines(3)
    assert [f.id for f in (await api.files.list()).data] == [uploaded.id]
    batches = [
        await api.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/completions",
            completion_window="24h",
            metadata={"job": str(i)},
        )
        for i in range(3)
    ]
    assert all(b.status == "validating" and b.request_counts.total == 0 for b in batches)
    assert batches[0].expires_at - batches[0].created_at == 24 * 3600
    page = await api.batches.list(limit=2)
    assert len(page.data) == 2 and page.has_more
    rest = await api.batches.list(after=page.data[-1].id, limit=2)
    assert {b.id for b in page.data} | {b.id for b in rest.data} == {b.id for b in batches}
    assert not rest.has_more
    cancelled = await api.batches.cancel(batches[0].id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
    # Its input is in use by batches that have not ended.
    with pytest.raises(openai.BadRequestError, match="has not ended"):
        await api.files.delete(uploaded.id)
    for batch in batches:
        store.write_final(batch.id, {"status": "cancelled", "cancelled_at": 1})
    with pytest.raises(openai.ConflictError, match="only a batch that has not ended"):
        await api.batches.cancel(batches[1].id)
    assert (await api.files.delete(uploaded.id)).deleted
    await http.aclose()


async def test_bad_input_gets_openai_errors(app: tuple[FastAPI, BatchStore]) -> None:
    gateway, _ = app
    async with client(gateway) as http:
        big = _lines(200)
        assert len(big) > MAX_FILE_BYTES
        response = await http.post(
            "/v1/files", files={"file": ("in.jsonl", big)}, data={"purpose": "batch"}
        )
        assert_error(response, 413, "larger than")
        response = await http.post(
            "/v1/files", files={"file": ("in.jsonl", _lines(1))}, data={"purpose": "fine-tune"}
        )
        assert_error(response, 400, "purpose")
        unknown = "file-" + "0" * 24
        for path in (f"/v1/files/{unknown}", f"/v1/files/{unknown}/content", "/v1/files/../etc"):
            assert (await http.get(path)).status_code == 404
        assert_error(await http.get(f"/v1/files/{unknown}"), 404, unknown)
        body = {"input_file_id": unknown, "endpoint": "/v1/completions", "completion_window": "24h"}
        assert_error(await http.post("/v1/batches", json=body), 404, unknown)
        uploaded = (
            await http.post(
                "/v1/files", files={"file": ("a", _lines(1))}, data={"purpose": "batch"}
            )
        ).json()
        body["input_file_id"] = uploaded["id"]
        for field, value, fragment in (
            ("endpoint", "/v1/embeddings", "not supported"),
            ("completion_window", "1d", "completion_window"),
            ("completion_window", "999h", "completion_window"),
        ):
            error = assert_error(
                await http.post("/v1/batches", json={**body, field: value}), 400, fragment
            )
            assert error["param"] == field
        assert_error(await http.get("/v1/batches/batch_" + "0" * 24), 404, "No such batch")
        assert_error(await http.post("/v1/batches/nope/cancel"), 404)
