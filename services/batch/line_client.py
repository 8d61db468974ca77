"""One batch line through the gateway at the lowest priority (for `nori serve batch` and
`nori run-batch`), retried until an answer that is not transient or its deadline (the batch's
expiry). Transient: 429, 502/503/504 and a connection that failed or dropped. Each retry waits
0.25, 0.5, 1, ... s, at most `MAX_BACKOFF_S`, or the answer's Retry-After when that is shorter.
Anything else is the line's answer, success or not, recorded with its status code and body."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from opentelemetry import trace

from nori.settings import BATCH_PRIORITY
from nori.telemetry.propagation import current_carrier

TRANSIENT_STATUSES = frozenset({429, 502, 503, 504})
MAX_BACKOFF_S = 8.0
FIRST_BACKOFF_S = 0.25


@dataclass(frozen=True)
class LineOutcome:
    """A line's answer as OpenAI's batch output writes it, with what run-batch reports."""

    ok: bool
    record: dict[str, Any]
    retries: int = 0
    latency_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # The line finished as it asked: no error, and not cut short by a limit it did not set.
    effective: bool = False


def output_record(
    record_id: str, custom_id: str, status: int, request_id: str, body: object
) -> dict[str, Any]:
    return {
        "id": record_id,
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def error_record(record_id: str, custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    return {
        "id": record_id,
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def is_effective(request_body: Mapping[str, Any], response_body: Mapping[str, Any]) -> bool:
    """Every choice ended on its own (stop) or on the token limit the line itself set."""
    choices = response_body.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    asked = request_body.get("max_completion_tokens", request_body.get("max_tokens"))
    for choice in choices:
        reason = choice.get("finish_reason") if isinstance(choice, dict) else None
        if reason == "stop":
            continue
        if reason == "length" and asked is not None:
            # "length" also comes from max_model_len, before max_tokens is reached.
            usage = response_body.get("usage") or {}
            per_choice = int(usage.get("completion_tokens", 0)) / len(choices)
            if per_choice >= int(asked):
                continue
        return False
    return True


async def send_line(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    record_id: str,
    custom_id: str,
    request_id: str,
    deadline: float,
    headers: Mapping[str, str] | None = None,
    span: trace.Span | None = None,
) -> LineOutcome:
    """POSTs `body` (non-streamed, at BATCH_PRIORITY) to `url` until a final answer."""
    payload = json.dumps({**body, "stream": False, "priority": BATCH_PRIORITY}).encode()
    send_headers = {
        "Content-Type": "application/json",
        "x-request-id": request_id,
        **(headers or {}),
        **current_carrier(span),
    }
    retries = 0
    backoff = FIRST_BACKOFF_S
    started = time.monotonic()
    while True:
        wait: float | None = None
        try:
            async with session.post(url, data=payload, headers=send_headers) as response:
                status = response.status
                text = await response.text()
                if status in TRANSIENT_STATUSES:
                    retry_after = response.headers.get("Retry-After", "")
                    wait = float(retry_after) if retry_after.replace(".", "", 1).isdigit() else None
                else:
                    answer: object
                    try:
                        answer = json.loads(text)
                    except ValueError:
                        answer = {"error": {"message": text, "type": "invalid_response"}}
                    return _outcome(
                        status, answer, body, record_id, custom_id, request_id, retries, started
                    )
        except (TimeoutError, aiohttp.ClientError, ConnectionError):
            pass  # the gateway restarting, or a dropped connection: try again
        if time.monotonic() + backoff > deadline:
            return LineOutcome(
                False,
                error_record(
                    record_id,
                    custom_id,
                    "batch_expired",
                    "the batch expired before this request could complete",
                ),
                retries=retries,
                latency_s=time.monotonic() - started,
            )
        retries += 1
        delay = min(backoff, wait) if wait is not None else backoff
        await asyncio.sleep(delay * (0.5 + random.random() / 2))
        backoff = min(MAX_BACKOFF_S, backoff * 2)


def _outcome(
    status: int,
    answer: object,
    body: Mapping[str, Any],
    record_id: str,
    custom_id: str,
    request_id: str,
    retries: int,
    started: float,
) -> LineOutcome:
    record = output_record(record_id, custom_id, status, request_id, answer)
    ok = 200 <= status < 300 and isinstance(answer, dict)
    usage = answer.get("usage") if isinstance(answer, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    return LineOutcome(
        ok,
        record,
        retries=retries,
        latency_s=time.monotonic() - started,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        effective=ok and isinstance(answer, dict) and is_effective(body, answer),
    )
