"""One streamed request to an OpenAI-compatible server, turned into a `RequestRecord`.

aiohttp (as `vllm bench serve` uses): the client shares the machine with the server it measures,
and its HTTP parser in C costs a fraction of a pure-Python one per streamed token.

Every request streams with `stream_options.include_usage`, so that token counts are the
server's own; without a usage report the prompt length is the local tokenizer's and the output
length the number of content chunks. Anything that stops a request from ending with
`data: [DONE]` makes it failed with the reason kept: a non-200 status (with the server's
message), an error event inside the stream, a broken connection, a malformed event, a timeout.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from nori.bench.serve.records import RequestRecord
from nori.bench.serve.settings import ServeBenchSettings
from nori.bench.serve.specs import RequestSpec
from nori.bench.serve.sse import DONE, data_payload, parse_chunk, response_error_text


@dataclass(frozen=True)
class RequestOptions:
    """What every request of a run shares."""

    endpoint_type: str
    # The endpoint's full URL.
    url: str
    model: str
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 3600.0

    @classmethod
    def from_settings(cls, settings: ServeBenchSettings, model: str) -> RequestOptions:
        return cls(
            endpoint_type=settings.endpoint_type,
            url=settings.base_url.rstrip("/") + settings.endpoint_path,
            model=model,
            temperature=settings.temperature,
            ignore_eos=settings.ignore_eos,
            timeout_s=settings.request_timeout_s,
        )


def request_body(spec: RequestSpec, options: RequestOptions) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": options.model,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if options.endpoint_type == "chat":
        if not isinstance(spec.prompt, str):
            raise ValueError("the chat endpoint takes text prompts only")
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        body["max_completion_tokens"] = spec.max_tokens
    else:
        body["prompt"] = spec.prompt if isinstance(spec.prompt, str) else list(spec.prompt)
        body["max_tokens"] = spec.max_tokens
    if options.ignore_eos:
        # Not in OpenAI's API; vLLM and Nori accept it. Sent only when asked for.
        body["ignore_eos"] = True
    return body


async def send_request(
    session: aiohttp.ClientSession,
    spec: RequestSpec,
    options: RequestOptions,
    index: int,
    origin: float,
) -> RequestRecord:
    """Sends now; times in the record are `time.perf_counter()` seconds since `origin`."""
    body = request_body(spec, options)
    chunk_times: list[float] = []
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    def record(error: str | None) -> RequestRecord:
        usage = prompt_tokens is not None and completion_tokens is not None
        return RequestRecord(
            index=index,
            request_class=spec.request_class,
            send_time=send_time,
            end_time=time.perf_counter() - origin,
            chunk_times=tuple(chunk_times),
            success=error is None,
            error=error,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens if prompt_tokens is not None else spec.prompt_len,
            output_tokens=completion_tokens if completion_tokens is not None else len(chunk_times),
            max_tokens=spec.max_tokens,
            usage_from_server=usage,
        )

    send_time = time.perf_counter() - origin
    try:
        async with (
            asyncio.timeout(options.timeout_s),
            session.post(options.url, json=body) as response,
        ):
            if response.status != 200:
                message = response_error_text(await response.read())
                # Kept in the reason: an overload run checks that every 429 says when to retry.
                retry_after = response.headers.get("Retry-After")
                hint = f" [Retry-After: {retry_after}]" if retry_after else ""
                return record(f"HTTP {response.status}: {message}{hint}")
            # Iterating the body yields it line by line.
            async for raw_line in response.content:
                payload = data_payload(raw_line.decode("utf-8"))
                if payload is None:
                    continue
                if payload == DONE:
                    return record(None)
                now = time.perf_counter() - origin
                chunk = parse_chunk(payload)
                if chunk.error is not None:
                    return record(f"stream error: {chunk.error}")
                if chunk.text:
                    chunk_times.append(now)
                if chunk.finish_reason is not None:
                    finish_reason = chunk.finish_reason
                if chunk.prompt_tokens is not None:
                    prompt_tokens = chunk.prompt_tokens
                if chunk.completion_tokens is not None:
                    completion_tokens = chunk.completion_tokens
            return record("the stream ended without data: [DONE]")
    except TimeoutError:
        return record(f"timed out after {options.timeout_s:g} s")
    except aiohttp.ClientError as error:
        return record(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
    except ValueError as error:
        return record(f"malformed stream event: {error}")


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id of GET /v1/models (what `vllm bench serve` does without --model)."""
    try:
        async with session.get(base_url.rstrip("/") + "/v1/models") as response:
            status, content = response.status, await response.read()
    except aiohttp.ClientError as error:
        raise ValueError(
            f"cannot list the server's models: {error or type(error).__name__}"
        ) from error
    if status != 200:
        raise ValueError(f"GET /v1/models answered {status}: {response_error_text(content)}")
    try:
        listing = json.loads(content)
    except ValueError:
        listing = None
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise ValueError("the server lists no models at GET /v1/models; pass --model")
    return str(data[0]["id"])
