"""OpenAI's Files and Batch API on the gateway (`--batch-dir`), as the `openai` client calls it.

The gateway only records: files, batch requests and cancel markers go to `nori.batch.store`'s
directory; batch runners (`nori serve batch`) validate, run and finalize. Counts come from Redis
while a batch runs (`nori.batch.jobs`), else the directory: a Redis restarted empty changes none."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse, JSONResponse
from opentelemetry import trace
from pydantic import BaseModel, ConfigDict, Field

from nori.batch.input_file import SUPPORTED_ENDPOINTS
from nori.batch.jobs import BatchJobs
from nori.batch.store import FINAL_STATUSES, BatchStore, RequestCounts, UnknownIdError
from nori.gateway.errors import APIError, bad_request

FILES_PATH = "/v1/files"
BATCHES_PATH = "/v1/batches"
# OpenAI's cap on a batch input file.
DEFAULT_MAX_FILE_BYTES = 200 * 1024 * 1024
_WINDOW = re.compile(r"^([1-9][0-9]{0,2})h$")
MAX_WINDOW_HOURS = 168
_COPY_CHUNK = 1 << 20


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


def _not_found(error: UnknownIdError) -> APIError:
    return APIError(HTTPStatus.NOT_FOUND, str(error), code="not_found")


def _page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page: the items after the one whose id is `after`."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


def batch_routes(store: BatchStore, jobs: BatchJobs | None) -> APIRouter:
    router = APIRouter()

    async def live_counts(batch_id: str) -> tuple[RequestCounts | None, bool]:
        """(the counts in Redis, whether a runner is finalizing); (None, False) without them."""
        validated = store.validated(batch_id)
        if jobs is None or validated is None or store.final(batch_id) is not None:
            return None, False
        try:
            counts = await jobs.counts(batch_id, int(validated["total"]))
            finalizing = bool(await jobs.redis.exists(jobs.keys.batch(batch_id, "lock:finalize")))
        except Exception:  # Redis away: the directory answers
            return None, False
        return counts, finalizing

    async def batch_object(batch_id: str) -> dict[str, Any]:
        try:
            counts, finalizing = await live_counts(batch_id)
            return await asyncio.to_thread(store.batch_object, batch_id, counts, finalizing)
        except UnknownIdError as error:
            raise _not_found(error) from None

    # ------------------------------------------------------------------ files

    @router.post(FILES_PATH)
    async def create_file(file: UploadFile, purpose: str = Form(...)) -> JSONResponse:
        if purpose != "batch":
            raise bad_request(f"purpose {purpose!r} is not supported; use 'batch'", "purpose")

        def chunks() -> Iterator[bytes]:
            while chunk := file.file.read(_COPY_CHUNK):
                yield chunk

        meta = await asyncio.to_thread(
            store.create_file, file.filename or "upload.jsonl", "batch", chunks()
        )
        return JSONResponse(meta)

    @router.get(FILES_PATH)
    async def list_files(
        purpose: str | None = None,
        after: str | None = None,
        limit: int = Query(10_000, ge=1, le=10_000),
        order: str = Query("desc", pattern="^(asc|desc)$"),
    ) -> JSONResponse:
        files = await asyncio.to_thread(store.list_files, purpose)
        if order == "asc":
            files.reverse()
        return JSONResponse(_page(files, after, limit))

    @router.get(FILES_PATH + "/{file_id}")
    async def retrieve_file(file_id: str) -> JSONResponse:
        try:
            return JSONResponse(store.file_meta(file_id))
        except UnknownIdError as error:
            raise _not_found(error) from None

    @router.get(FILES_PATH + "/{file_id}/content")
    async def file_content(file_id: str) -> FileResponse:
        try:
            path = store.file_path(file_id)
        except UnknownIdError as error:
            raise _not_found(error) from None
        return FileResponse(path, media_type="application/octet-stream")

    @router.delete(FILES_PATH + "/{file_id}")
    async def delete_file(file_id: str) -> JSONResponse:
        try:
            store.file_meta(file_id)
            for batch_id in store.active_batch_ids():
                if store.batch_request(batch_id)["input_file_id"] == file_id:
                    raise bad_request(
                        f"file {file_id} is the input of batch {batch_id}, which has not "
                        "ended; cancel it first"
                    )
            await asyncio.to_thread(store.delete_file, file_id)
        except UnknownIdError as error:
            raise _not_found(error) from None
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    # ------------------------------------------------------------------ batches

    @router.post(BATCHES_PATH)
    async def create_batch(body: CreateBatchRequest, request: Request) -> JSONResponse:
        if body.endpoint not in SUPPORTED_ENDPOINTS:
            raise bad_request(
                f"endpoint {body.endpoint!r} is not supported; use one of "
                f"{', '.join(SUPPORTED_ENDPOINTS)}",
                "endpoint",
            )
        window = _WINDOW.match(body.completion_window)
        if window is None or int(window.group(1)) > MAX_WINDOW_HOURS:
            raise bad_request(
                f"completion_window {body.completion_window!r}: give hours, e.g. '24h' "
                f"(at most {MAX_WINDOW_HOURS}h)",
                "completion_window",
            )
        try:
            meta = store.file_meta(body.input_file_id)
        except UnknownIdError as error:
            raise _not_found(error) from None
        if meta["purpose"] != "batch":
            raise bad_request(
                f"file {body.input_file_id} has purpose {meta['purpose']!r}, not 'batch'",
                "input_file_id",
            )
        now = int(time.time())
        context = trace.get_current_span().get_span_context()
        batch_id = store.create_batch(
            {
                "input_file_id": body.input_file_id,
                "endpoint": body.endpoint,
                "completion_window": body.completion_window,
                "metadata": body.metadata,
                "created_at": now,
                "expires_at": now + 3600 * int(window.group(1)),
                # The runners' line spans link to the span that created the batch.
                "trace": {
                    "trace_id": format(context.trace_id, "032x"),
                    "span_id": format(context.span_id, "016x"),
                }
                if context.is_valid
                else None,
            }
        )
        return JSONResponse(await batch_object(batch_id))

    @router.get(BATCHES_PATH + "/{batch_id}")
    async def retrieve_batch(batch_id: str) -> JSONResponse:
        return JSONResponse(await batch_object(batch_id))

    @router.get(BATCHES_PATH)
    async def list_batches(
        after: str | None = None, limit: int = Query(20, ge=1, le=100)
    ) -> JSONResponse:
        ids = await asyncio.to_thread(store.batch_ids)
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        page = [await batch_object(batch_id) for batch_id in ids[:limit]]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(ids) > limit,
            }
        )

    @router.post(BATCHES_PATH + "/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> JSONResponse:
        try:
            status = store.status(batch_id)
            if status in FINAL_STATUSES:
                raise APIError(
                    HTTPStatus.CONFLICT,
                    f"batch {batch_id} has status {status!r}: only a batch that has not ended "
                    "can be cancelled",
                )
            store.cancel(batch_id)
        except UnknownIdError as error:
            raise _not_found(error) from None
        return JSONResponse(await batch_object(batch_id))

    return router


def batch_status_counts(store: BatchStore) -> dict[str, int]:
    """Batches by status (for /metrics)."""
    counts: dict[str, int] = {}
    for batch_id in store.batch_ids():
        status = store.status(batch_id)
        counts[status] = counts.get(status, 0) + 1
    return counts
