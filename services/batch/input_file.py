"""Checking a batch's input file: OpenAI's batch line format, one request per line.

A malformed line (not JSON, a field missing or mistyped, another endpoint, `stream`) fails
alone, in the error file with its line number. A duplicate `custom_id`, an empty file or too many
lines fail the whole batch at validation, with the lines named in `errors`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nori.batch.store import ValidLine

# OpenAI's limit per batch.
MAX_LINES = 50_000
SUPPORTED_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class CheckedInput:
    total: int = 0
    lines: list[ValidLine] = field(default_factory=list)
    # Lines that fail alone: {"line", "code", "message", "custom_id"}.
    line_errors: list[dict[str, Any]] = field(default_factory=list)
    # Errors that fail the whole batch (OpenAI's `errors.data` entries).
    batch_errors: list[dict[str, Any]] = field(default_factory=list)


def _line_error(line: int, message: str, custom_id: object = None) -> dict[str, Any]:
    return {
        "code": "invalid_request",
        "message": f"line {line}: {message}",
        "param": None,
        "line": line,
        "custom_id": custom_id if isinstance(custom_id, str) else None,
    }


def check_line(
    raw: bytes, line: int, endpoint: str | None
) -> tuple[str, dict[str, Any] | None, str]:
    """(custom_id or "", the parsed line or None, the error message or ""). `endpoint`: the
    batch's, or None for any supported one (`nori run-batch` takes each line's own)."""
    try:
        entry = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        return "", None, f"not valid JSON ({error})"
    if not isinstance(entry, dict):
        return "", None, "a line must be a JSON object"
    custom_id = entry.get("custom_id")
    name = custom_id if isinstance(custom_id, str) else ""
    if not isinstance(custom_id, str) or not custom_id:
        return name, None, "'custom_id' must be a non-empty string"
    if entry.get("method") != "POST":
        return name, None, "'method' must be \"POST\""
    if endpoint is None and entry.get("url") not in SUPPORTED_ENDPOINTS:
        return name, None, f"'url' must be one of {', '.join(SUPPORTED_ENDPOINTS)}"
    if endpoint is not None and entry.get("url") != endpoint:
        return (
            name,
            None,
            f"'url' must be the batch's endpoint {endpoint!r}, got {entry.get('url')!r}",
        )
    body = entry.get("body")
    if not isinstance(body, dict):
        return name, None, "'body' must be a JSON object"
    if body.get("stream"):
        return name, None, "'stream' is not supported in a batch"
    return name, entry, ""


def check_input(path: Path, endpoint: str | None, max_lines: int = MAX_LINES) -> CheckedInput:
    """Reads the file once, line by line (never whole into memory)."""
    checked = CheckedInput()
    seen: dict[str, int] = {}
    offset = 0
    with path.open("rb") as source:
        for line_no, raw in enumerate(source, start=1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue  # a blank line (a trailing newline) is no request
            checked.total += 1
            if checked.total > max_lines:
                checked.batch_errors.append(
                    {
                        "code": "too_many_lines",
                        "message": f"the input has more than {max_lines} requests",
                        "param": None,
                        "line": line_no,
                    }
                )
                return checked
            custom_id, entry, error = check_line(raw, line_no, endpoint)
            if entry is None:
                checked.line_errors.append(_line_error(line_no, error, custom_id or None))
                continue
            if custom_id in seen:
                checked.batch_errors.append(
                    {
                        "code": "duplicate_custom_id",
                        "message": f"line {line_no}: custom_id {custom_id!r} is already used "
                        f"on line {seen[custom_id]}",
                        "param": "custom_id",
                        "line": line_no,
                    }
                )
                continue
            seen[custom_id] = line_no
            checked.lines.append(ValidLine(line_no, start, len(raw), custom_id))
    if checked.total == 0:
        checked.batch_errors.append(
            {
                "code": "empty_file",
                "message": "the input file has no requests",
                "param": None,
                "line": None,
            }
        )
    return checked
