"""One client's wide request beside other clients' single requests, against a running cluster.

    nori up --prefill 1 --decode 2 --port 8000 &
    python bench/wide_request_fairness.py http://127.0.0.1:8000 [--prompts 60 --n 64 --users 12]

1. The users (a Bearer token each: each its own client) stream one completion each at once on
   the idle cluster, twice (the first is the cold one): each user's TTFT alone.
2. Another client sends one request of prompts x n choices (3,840 by default, under the 4,096
   cap); a second later the same users send again. Printed: each user's status and TTFT, its
   ratio to its TTFT alone, how many got 200 within 3x, and the wide request's status and time.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx


async def _stream_ttft(
    client: httpx.AsyncClient, url: str, model: str, key: str
) -> tuple[int, float | None, str]:
    started = time.perf_counter()
    body = {"model": model, "prompt": f"User {key} asks", "max_tokens": 8, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", f"{url}/v1/completions", headers=headers, json=body) as reply:
        if reply.status_code != 200:
            text = (await reply.aread()).decode(errors="replace")
            return reply.status_code, None, text[:160]
        ttft = None
        async for line in reply.aiter_lines():
            if line.startswith("data:") and '"text"' in line and ttft is None:
                ttft = time.perf_counter() - started
        return 200, ttft, ""


async def _users(
    client: httpx.AsyncClient, url: str, model: str, users: int
) -> list[tuple[int, float | None, str]]:
    calls = (_stream_ttft(client, url, model, f"user-{i}") for i in range(users))
    return list(await asyncio.gather(*calls))


async def check(url: str, model: str, prompts: int, n: int, users: int, delay_s: float) -> None:
    async with httpx.AsyncClient(timeout=900) as client:
        await _users(client, url, model, users)  # cold
        alone = await _users(client, url, model, users)
        body = {
            "model": model,
            "prompt": [f"Hello world {i}" for i in range(prompts)],
            "n": n,
            "max_tokens": 4,
            "ignore_eos": True,
        }
        started = time.perf_counter()
        headers = {"Authorization": "Bearer the-wide-one"}
        wide = asyncio.create_task(client.post(f"{url}/v1/completions", headers=headers, json=body))
        await asyncio.sleep(delay_s)
        loaded = await _users(client, url, model, users)
        users_done = time.perf_counter() - started
        reply = await wide
        wide_s = time.perf_counter() - started
    in_time = 0
    print("user  alone TTFT   beside: status  TTFT     ratio")
    for i, ((_, before, _), (status, after, error)) in enumerate(zip(alone, loaded, strict=True)):
        ratio = after / before if after is not None and before else None
        in_time += status == 200 and ratio is not None and ratio <= 3
        print(
            f"{i:4d}  {before or float('nan'):8.3f} s  {status:13d}  "
            + (f"{after:6.3f} s  {ratio:5.1f}x" if ratio is not None else f"  -  {error}")
        )
    print(f"served (200) within 3x their TTFT alone: {in_time}/{users}")
    print(f"the users' requests were done {users_done:.1f} s after the wide one was sent")
    print(f"{prompts} x n={n}: {reply.status_code} in {wide_s:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--users", type=int, default=12)
    parser.add_argument("--delay-s", type=float, default=1.0)
    args = parser.parse_args()
    asyncio.run(
        check(args.url.rstrip("/"), args.model, args.prompts, args.n, args.users, args.delay_s)
    )


if __name__ == "__main__":
    main()
