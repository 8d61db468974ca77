"""A runner's two whole-batch steps, each by one runner under the batch's Redis lock and written
atomically: `validate_batch` and `finalize_batch` (output and error files in input order, then
final.json). File ids derive from the batch's, so a redo writes the same files."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from typing import Any

from nori.batch.input_file import check_input
from nori.batch.jobs import BatchJobs
from nori.batch.line_client import error_record
from nori.batch.store import BatchStore, RequestCounts, ValidLine

logger = logging.getLogger(__name__)

_LOCK_MS = 300_000


async def validate_batch(
    store: BatchStore, jobs: BatchJobs, batch_id: str, request: dict[str, Any]
) -> None:
    """Checks a new batch's input: valid lines make it in_progress, a batch-wide error fails it;
    nothing to do if another runner holds the lock or did it."""
    if not await jobs.lock(batch_id, "validate", _LOCK_MS):
        return
    try:
        if store.is_validated(batch_id):
            return
        path = store.file_path(request["input_file_id"])
        checked = await asyncio.to_thread(check_input, path, request["endpoint"])
        if checked.batch_errors:
            now = int(time.time())
            store.write_final(
                batch_id,
                {
                    "status": "failed",
                    "failed_at": now,
                    "errors": checked.batch_errors,
                    "request_counts": RequestCounts(0, 0, 0).as_dict(),
                },
            )
            logger.info("batch %s failed validation: %s", batch_id, checked.batch_errors[0])
            return
        store.write_validated(batch_id, checked.total, checked.lines, checked.line_errors)
        logger.info(
            "batch %s: %d lines, %d invalid", batch_id, checked.total, len(checked.line_errors)
        )
    except FileNotFoundError:
        logger.warning("batch %s: its input file is gone", batch_id)
    finally:
        await jobs.unlock(batch_id, "validate")


async def finalize_batch(
    store: BatchStore, jobs: BatchJobs, batch_id: str, lines: list[ValidLine], status: str
) -> bool:
    """Writes the output and error files and final.json, then forgets the batch in Redis; False
    when another runner holds the lock or did it. `status`: completed, cancelled or expired."""
    if not await jobs.lock(batch_id, "finalize", _LOCK_MS):
        return False
    try:
        if store.final(batch_id) is not None:
            return False
        finalizing_at = int(time.time())
        final = await asyncio.to_thread(
            _write_output_files, store, batch_id, lines, status, finalizing_at
        )
        store.write_final(batch_id, final)
        logger.info("batch %s %s: %s", batch_id, status, final["request_counts"])
    finally:
        await jobs.unlock(batch_id, "finalize")
    await jobs.forget(batch_id)
    return True


def line_record_id(batch_id: str, line: int) -> str:
    """The id of a line's output record: the same for every runner and every retry."""
    return f"batch_req_{hashlib.sha256(f'{batch_id}/{line}'.encode()).hexdigest()[:24]}"


def _write_output_files(
    store: BatchStore, batch_id: str, lines: list[ValidLine], status: str, finalizing_at: int
) -> dict[str, Any]:
    """Writes the batch's output and error files; returns its final.json (not yet written)."""
    validated = store.validated(batch_id) or {"errors": [], "total": 0}
    results = store.read_results(batch_id)
    by_line: list[tuple[int, bool, dict[str, Any]]] = []
    for error in validated["errors"]:
        record = error_record(
            line_record_id(batch_id, error["line"]),
            error["custom_id"],
            error["code"],
            error["message"],
        )
        by_line.append((int(error["line"]), False, record))
    for line in lines:
        result = results.get(line.line)
        if result is not None:
            by_line.append((line.line, result.ok, result.record))
        elif status == "expired":
            record = error_record(
                line_record_id(batch_id, line.line),
                line.custom_id,
                "batch_expired",
                "this request could not be executed before the completion window expired",
            )
            by_line.append((line.line, False, record))
    by_line.sort(key=lambda entry: entry[0])
    outputs = [record for _, ok, record in by_line if ok]
    errors = [record for _, ok, record in by_line if not ok]
    final: dict[str, Any] = {
        "status": status,
        "finalizing_at": finalizing_at,
        f"{status}_at": int(time.time()),
        "output_file_id": None,
        "error_file_id": None,
        "request_counts": RequestCounts(
            int(validated["total"]), len(outputs), len(errors)
        ).as_dict(),
    }
    for kind, records in (("output", outputs), ("error", errors)):
        if records or (kind == "output" and status == "completed"):
            file_id = "file-" + hashlib.sha256(f"{batch_id}/{kind}".encode()).hexdigest()[:24]
            chunks = (json.dumps(record).encode() + b"\n" for record in records)
            store.create_file(f"{batch_id}_{kind}.jsonl", "batch_output", chunks, file_id)
            final[f"{kind}_file_id"] = file_id
    return final
