"""The batch directory (`--batch-dir`): uploaded files, batches and their results, on disk.

The directory is the source of truth; Redis (`nori.batch.jobs`) holds only what can be rebuilt.
Files are written whole and atomically, except the runners' result logs, fsync'd before a line
counts as done; a line logged twice keeps its first record. Layout: docs/architecture.md."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from nori.batch.durable_writes import write_atomically

FilePurpose = Literal["batch", "batch_output"]
BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
FINAL_STATUSES: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})

_FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
_BATCH_ID = re.compile(r"^batch_[0-9a-f]{24}$")
_RUNNER_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class UnknownIdError(LookupError):
    """No file or batch of that id (404)."""


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class RequestCounts:
    total: int
    completed: int
    failed: int

    def as_dict(self) -> dict[str, int]:
        return {"total": self.total, "completed": self.completed, "failed": self.failed}


@dataclass(frozen=True)
class ValidLine:
    line: int  # 1-based, as editors and OpenAI's errors count
    offset: int
    length: int
    custom_id: str


@dataclass(frozen=True)
class LineResult:
    line: int
    ok: bool
    record: dict[str, Any]

    def to_json(self) -> bytes:
        return json.dumps({"line": self.line, "ok": self.ok, "record": self.record}).encode()


class BatchStore:
    """Files and batches in one directory, shareable by processes and hosts on one volume."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files_dir = root / "files"
        self.batches_dir = root / "batches"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.batches_dir.mkdir(parents=True, exist_ok=True)

    def file_dir(self, file_id: str) -> Path:
        if not _FILE_ID.match(file_id):
            raise UnknownIdError(f"No such File object: {file_id}")
        return self.files_dir / file_id

    def create_file(
        self,
        filename: str,
        purpose: FilePurpose,
        chunks: Iterator[bytes],
        file_id: str | None = None,
    ) -> dict[str, Any]:
        """Writes the content, then its meta (the file exists once meta.json does)."""
        file_id = file_id or new_file_id()
        folder = self.file_dir(file_id)
        folder.mkdir(exist_ok=True)
        size = 0
        tmp = folder / ".content.tmp"
        with tmp.open("wb") as out:
            for chunk in chunks:
                out.write(chunk)
                size += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, folder / "content")
        meta = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
        write_atomically(folder / "meta.json", json.dumps(meta).encode())
        return meta

    def file_meta(self, file_id: str) -> dict[str, Any]:
        meta = _read_json(self.file_dir(file_id) / "meta.json")
        if meta is None:
            raise UnknownIdError(f"No such File object: {file_id}")
        return meta

    def file_path(self, file_id: str) -> Path:
        self.file_meta(file_id)
        return self.file_dir(file_id) / "content"

    def list_files(self, purpose: str | None = None) -> list[dict[str, Any]]:
        """Newest first, as OpenAI lists them."""
        metas = []
        for folder in self.files_dir.iterdir():
            meta = _read_json(folder / "meta.json")
            if meta is not None and (purpose is None or meta.get("purpose") == purpose):
                metas.append(meta)
        return sorted(metas, key=lambda m: (m["created_at"], m["id"]), reverse=True)

    def delete_file(self, file_id: str) -> None:
        folder = self.file_dir(file_id)
        self.file_meta(file_id)
        # Renamed first: a reader sees the file whole or not at all.
        doomed = self.files_dir / f".deleted-{file_id}-{secrets.token_hex(4)}"
        os.replace(folder, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def batch_dir(self, batch_id: str) -> Path:
        if not _BATCH_ID.match(batch_id):
            raise UnknownIdError(f"No such batch: {batch_id}")
        return self.batches_dir / batch_id

    def create_batch(self, request: dict[str, Any]) -> str:
        """`request`: input_file_id, endpoint, completion_window, metadata, times, trace context."""
        batch_id = new_batch_id()
        folder = self.batch_dir(batch_id)
        (folder / "results").mkdir(parents=True)
        write_atomically(folder / "batch.json", json.dumps({"id": batch_id, **request}).encode())
        return batch_id

    def batch_request(self, batch_id: str) -> dict[str, Any]:
        request = _read_json(self.batch_dir(batch_id) / "batch.json")
        if request is None:
            raise UnknownIdError(f"No such batch: {batch_id}")
        return request

    def batch_ids(self) -> list[str]:
        """Every batch, newest first (ids are random: by creation time, from the folder)."""
        found = []
        for folder in self.batches_dir.iterdir():
            if _BATCH_ID.match(folder.name) and (folder / "batch.json").exists():
                found.append((folder.stat().st_mtime_ns, folder.name))
        return [batch_id for _, batch_id in sorted(found, reverse=True)]

    def active_batch_ids(self) -> list[str]:
        """Batches not yet final, oldest first (first come, first served)."""
        return [
            b for b in reversed(self.batch_ids()) if not (self.batch_dir(b) / "final.json").exists()
        ]

    def validated(self, batch_id: str) -> dict[str, Any] | None:
        return _read_json(self.batch_dir(batch_id) / "validated.json")

    def is_validated(self, batch_id: str) -> bool:
        """Without reading validated.json (megabytes for a big batch)."""
        return (self.batch_dir(batch_id) / "validated.json").exists()

    def valid_lines(self, batch_id: str) -> list[ValidLine]:
        validated = self.validated(batch_id) or {}
        return [ValidLine(*entry) for entry in validated.get("lines", [])]

    def write_validated(
        self, batch_id: str, total: int, lines: list[ValidLine], errors: list[dict[str, Any]]
    ) -> None:
        body = {
            "in_progress_at": int(time.time()),
            "total": total,
            "lines": [[v.line, v.offset, v.length, v.custom_id] for v in lines],
            "errors": errors,
        }
        write_atomically(self.batch_dir(batch_id) / "validated.json", json.dumps(body).encode())

    def read_line(self, batch_id: str, line: ValidLine) -> bytes:
        input_file_id = self.batch_request(batch_id)["input_file_id"]
        with (self.file_dir(input_file_id) / "content").open("rb") as source:
            source.seek(line.offset)
            return source.read(line.length)

    def cancel(self, batch_id: str) -> None:
        path = self.batch_dir(batch_id) / "cancel.json"
        if not path.exists():
            write_atomically(path, json.dumps({"cancelling_at": int(time.time())}).encode())

    def cancelling_at(self, batch_id: str) -> int | None:
        marker = _read_json(self.batch_dir(batch_id) / "cancel.json")
        return None if marker is None else int(marker["cancelling_at"])

    def final(self, batch_id: str) -> dict[str, Any] | None:
        return _read_json(self.batch_dir(batch_id) / "final.json")

    def write_final(self, batch_id: str, final: dict[str, Any]) -> None:
        write_atomically(self.batch_dir(batch_id) / "final.json", json.dumps(final).encode())

    def result_log(self, batch_id: str, runner_id: str) -> Path:
        if not _RUNNER_ID.match(runner_id):
            raise ValueError(f"runner id {runner_id!r}: letters, digits, '_', '.', '-' only")
        return self.batch_dir(batch_id) / "results" / f"{runner_id}.jsonl"

    def read_results(self, batch_id: str) -> dict[int, LineResult]:
        """Every line's first durable result; a torn last line (its runner killed) is skipped."""
        results: dict[int, LineResult] = {}
        folder = self.batch_dir(batch_id) / "results"
        with contextlib.suppress(FileNotFoundError):
            for log in sorted(folder.glob("*.jsonl")):
                for raw in log.read_bytes().splitlines():
                    try:
                        entry = json.loads(raw)
                        result = LineResult(int(entry["line"]), bool(entry["ok"]), entry["record"])
                    except (ValueError, KeyError, TypeError):
                        continue
                    results.setdefault(result.line, result)
        return results

    def counts_from_disk(self, batch_id: str) -> RequestCounts:
        validated = self.validated(batch_id)
        if validated is None:
            return RequestCounts(0, 0, 0)
        results = self.read_results(batch_id)
        completed = sum(1 for r in results.values() if r.ok)
        failed = len(validated["errors"]) + len(results) - completed
        return RequestCounts(int(validated["total"]), completed, failed)

    def status(self, batch_id: str, finalizing: bool = False) -> BatchStatus:
        final = self.final(batch_id)
        if final is not None:
            status: BatchStatus = final["status"]
            return status
        if self.cancelling_at(batch_id) is not None:
            return "cancelling"
        if not self.is_validated(batch_id):
            return "validating"
        return "finalizing" if finalizing else "in_progress"

    def batch_object(
        self, batch_id: str, counts: RequestCounts | None = None, finalizing: bool = False
    ) -> dict[str, Any]:
        """The batch as OpenAI's API returns it; `counts`: the live counts, else from the logs."""
        request = self.batch_request(batch_id)
        validated = self.validated(batch_id)
        final = self.final(batch_id) or {}
        if "request_counts" in final:
            counts = RequestCounts(**final["request_counts"])
        elif counts is None:
            counts = self.counts_from_disk(batch_id)
        errors = final.get("errors") or (validated or {}).get("errors") or []
        return {
            "id": batch_id,
            "object": "batch",
            "endpoint": request["endpoint"],
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": request["input_file_id"],
            "completion_window": request["completion_window"],
            "status": self.status(batch_id, finalizing),
            "output_file_id": final.get("output_file_id"),
            "error_file_id": final.get("error_file_id"),
            "created_at": request["created_at"],
            "in_progress_at": (validated or {}).get("in_progress_at"),
            "expires_at": request["expires_at"],
            "finalizing_at": final.get("finalizing_at"),
            "completed_at": final.get("completed_at"),
            "failed_at": final.get("failed_at"),
            "expired_at": final.get("expired_at"),
            "cancelling_at": self.cancelling_at(batch_id),
            "cancelled_at": final.get("cancelled_at"),
            "request_counts": counts.as_dict(),
            "metadata": request.get("metadata"),
        }
