"""What deploy/compose_check.py sends and reads: the gateway's clients, and n long completion
streams at once with an action run once every stream has its first token.

Contract: `run_streams` returns one StreamResult per stream, in order; a stream's failure is
recorded in its result (error), never raised. The gateway's address and key come from
NORI_CHECK_BASE_URL and NORI_CHECK_API_KEY, the model from NORI_CHECK_MODEL or /v1/models.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

import openai

BASE_URL = os.environ.get("NORI_CHECK_BASE_URL", "http://127.0.0.1:8000")
API_KEY = os.environ.get("NORI_CHECK_API_KEY", "none")


def client(**kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=BASE_URL + "/v1", api_key=API_KEY, max_retries=0, **kwargs)


def aclient(**kwargs: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=BASE_URL + "/v1", api_key=API_KEY, max_retries=0, **kwargs)


def model_name() -> str:
    if os.environ.get("NORI_CHECK_MODEL"):
        return os.environ["NORI_CHECK_MODEL"]
    return client(timeout=30).models.list().data[0].id


def say(*parts: Any) -> None:
    print(*parts, flush=True)


# ------------------------------------------------------------------------------ long streams


@dataclass
class StreamResult:
    tokens: int = 0
    chunks: int = 0
    finish: str | None = None
    error: str | None = None
    first_token_s: float | None = None
    done_s: float | None = None


async def one_stream(
    ac: openai.AsyncOpenAI, model: str, i: int, max_tokens: int, t0: float, result: StreamResult
) -> None:
    try:
        stream = await ac.completions.create(
            model=model,
            prompt=f"Stream {i}: once upon a time",
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                result.tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                result.chunks += 1
                if result.first_token_s is None:
                    result.first_token_s = time.monotonic() - t0
                result.finish = choice.finish_reason or result.finish
    except Exception as error:
        result.error = f"{type(error).__name__}: {error}"
    result.done_s = time.monotonic() - t0


def run_streams(
    n: int, max_tokens: int, during: Any = None, after_first: float = 0.0
) -> tuple[list[StreamResult], float, Any]:
    """n streams of max_tokens at once; `during()` runs in a thread once every stream has its
    first token (and after_first seconds more). Returns the results, the wall time, and what
    `during` returned."""
    model = model_name()

    async def go() -> tuple[list[StreamResult], float, Any]:
        ac = aclient(timeout=900.0)
        t0 = time.monotonic()
        results = [StreamResult() for _ in range(n)]

        tasks = [
            asyncio.create_task(one_stream(ac, model, i, max_tokens, t0, results[i]))
            for i in range(n)
        ]
        during_result = None
        if during is not None:
            # Every stream has started producing tokens (or ended) before the action.
            while not all(t.done() for t in tasks):
                if all(r.first_token_s is not None or r.done_s is not None for r in results):
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(after_first)
            during_result = await asyncio.to_thread(during)
        await asyncio.gather(*tasks)
        return results, time.monotonic() - t0, during_result

    return asyncio.run(go())


def report_streams(results: list[StreamResult], max_tokens: int) -> int:
    complete = 0
    for i, r in enumerate(results):
        ok = r.error is None and r.tokens == max_tokens and r.finish == "length"
        complete += ok
        say(
            f"  stream {i}: {r.tokens} tokens ({r.chunks} chunks), finish_reason={r.finish},"
            f" done at {r.done_s or 0:.1f} s" + (f", ERROR {r.error}" if r.error else "")
        )
    say(f"{complete}/{len(results)} streams complete ({max_tokens} tokens each)")
    return complete
