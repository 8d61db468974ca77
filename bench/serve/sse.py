"""Reading an OpenAI-style event stream: `data: {...}` lines until `data: [DONE]`.

Both endpoints' chunks are read the same way: the text is `choices[0].text` (completions) or
`choices[0].delta.content` (chat); `usage` comes on the last chunk with
`stream_options.include_usage`; an error after the response has started arrives as one
`data: {"error": {...}}` event (vLLM's convention, and Nori's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


@dataclass(frozen=True)
class StreamChunk:
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


def data_payload(line: str) -> str | None:
    """The payload of a `data:` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


def parse_chunk(payload: str) -> StreamChunk:
    """One event's JSON. Raises ValueError when it is not a JSON object."""
    data = json.loads(payload)
    if not isinstance(data, dict):
        raise ValueError(f"stream event is not a JSON object: {payload[:200]}")
    if data.get("error") is not None or data.get("object") == "error":
        return StreamChunk(error=error_text(data))
    text, finish_reason = "", None
    choices = data.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        text = content if isinstance(content, str) else ""
        reason = choice.get("finish_reason")
        finish_reason = reason if isinstance(reason, str) else None
    usage = data.get("usage")
    if not isinstance(usage, dict):
        usage = {}
    return StreamChunk(
        text=text,
        finish_reason=finish_reason,
        prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
        completion_tokens=_int_or_none(usage.get("completion_tokens")),
    )


def error_text(body: Any) -> str:
    """The message of an error body: OpenAI's `{"error": {"message"}}`, vLLM's older
    `{"object": "error", "message"}`, FastAPI's `{"detail"}`, else the body itself."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("message", "detail"):
            if isinstance(body.get(key), str):
                return str(body[key])
    return str(body)[:500]


def response_error_text(content: bytes) -> str:
    """The message of a non-200 response's body, JSON or not."""
    text = content.decode("utf-8", errors="replace")
    try:
        return error_text(json.loads(text))
    except ValueError:
        return text.strip()[:500] or "(empty body)"


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
