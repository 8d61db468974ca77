"""Interactive requests beside a batch (issue 23): does batch work fill the capacity interactive
work leaves, without making interactive work wait?

On a local cluster (`nori up`'s layout: 1 prefill, 2 decode workers, one batch runner, the CPU
plan), three phases, each a window of `--window-s` seconds:

- interactive alone: `--clients` concurrent streams, each sending request after request
  (ShareGPT prompts, `--interactive-max-tokens`), timing the first token;
- batch alone: a `--batch-lines` batch through the Batch API, its output tokens/s read from the
  runner's `nori_batch_output_tokens_total` over the window (after a warm-up);
- both: the batch running, the same interactive load beside it.

Reported: interactive 429s and TTFT p50/p99 alone and beside the batch (the ratio), and output
tokens/s of the batch alone against both together (batch + interactive). Each phase's batch is
cancelled at the end of its window. Run: python -m nori.bench.batch_interactive --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

SHAREGPT = Path(__file__).resolve().parents[2] / "shared/data/sharegpt/ShareGPT_V3_sample2000.json"


@dataclasses.dataclass
class InteractiveFigures:
    ttfts: list[float] = dataclasses.field(default_factory=list)
    statuses: dict[int, int] = dataclasses.field(default_factory=dict)
    output_tokens: int = 0

    def summary(self) -> dict[str, Any]:
        ttfts = sorted(self.ttfts)
        pick = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else None  # noqa: E731
        return {
            "requests": len(ttfts),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "ttft_p50_s": pick(0.5),
            "ttft_p99_s": pick(0.99),
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
            "output_tokens": self.output_tokens,
        }


async def interactive_load(
    url: str, model: str, prompts: list[str], clients: int, max_tokens: int, seconds: float
) -> InteractiveFigures:
    figures = InteractiveFigures()
    deadline = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession, index: int) -> None:
        turn = 0
        while time.monotonic() < deadline:
            prompt = prompts[(index * 997 + turn) % len(prompts)]
            turn += 1
            body = {
                "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            }  # fmt: skip
            started = time.monotonic()
            first: float | None = None
            async with session.post(f"{url}/v1/completions", json=body) as response:
                figures.statuses[response.status] = figures.statuses.get(response.status, 0) + 1
                if response.status != 200:
                    await response.read()
                    await asyncio.sleep(0.5)
                    continue
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[5:])
                    if first is None and event.get("choices") and event["choices"][0].get("text"):
                        first = time.monotonic() - started
                    if event.get("usage"):
                        figures.output_tokens += int(event["usage"]["completion_tokens"])
            if first is not None:
                figures.ttfts.append(first)

    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session, i) for i in range(clients)))
    return figures


def runner_tokens(metrics_url: str) -> float:
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("nori_batch_output_tokens_total "):
                return float(line.split()[1])
    return 0.0


def submit_batch(url: str, model: str, prompts: list[str], num: int, max_tokens: int) -> str:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    lines = [
        json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": model, "prompt": prompts[i % len(prompts)],
                             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})
        for i in range(num)
    ]  # fmt: skip
    uploaded = client.files.create(file=("b.jsonl", "\n".join(lines).encode()), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    ).id


def cancel_batch(url: str, batch_id: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    client.batches.cancel(batch_id)
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch_id).status != "cancelled" and time.monotonic() < deadline:
        time.sleep(0.5)


def batch_window(metrics_url: str, warmup_s: float, window_s: float) -> float:
    time.sleep(warmup_s)
    start, started = runner_tokens(metrics_url), time.monotonic()
    time.sleep(window_s)
    return (runner_tokens(metrics_url) - start) / (time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--interactive-max-tokens", type=int, default=64)
    parser.add_argument("--batch-lines", type=int, default=2000)
    parser.add_argument("--batch-max-tokens", type=int, default=128)
    parser.add_argument(
        "--up-args",
        default="",
        help="more `nori up` flags for the cluster, e.g. '--background-prefill-budget 0' (A/B)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from nori.bench.serve.sharegpt import first_exchange
    from nori.cli.main import build_parser
    from nori.cli.up import prepare_cluster
    from nori.launch.local_cluster import LocalCluster, free_port

    data = json.loads(SHAREGPT.read_text())
    rng = np.random.default_rng(0)
    texts = [pair[0][:2000] for entry in data if (pair := first_exchange(entry))]
    prompts = [texts[int(i)] for i in rng.permutation(len(texts))]

    metrics_port = free_port()
    up_args = build_parser().parse_args(
        ["up", "--prefill", "1", "--decode", "2", "--port", str(free_port()),
         "--batch-dir", tempfile.mkdtemp(prefix="nori-bench-batches-"),
         "--log-dir", str(out / "logs"), *shlex.split(args.up_args)]
    )  # fmt: skip
    spec, redis_server = prepare_cluster(up_args)
    spec = dataclasses.replace(spec, batch_runner_args=("--metrics-port", str(metrics_port)))
    cluster = LocalCluster(spec)
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    model = spec.served_model_name or "demo"
    report: dict[str, Any] = {
        "window_s": args.window_s,
        "clients": args.clients,
        "up_args": args.up_args,
    }
    try:
        cluster.start(timeout_s=300)
        url = cluster.url
        load = lambda: asyncio.run(  # noqa: E731
            interactive_load(url, model, prompts, args.clients, args.interactive_max_tokens,
                             args.window_s)
        )  # fmt: skip
        asyncio.run(
            interactive_load(url, model, prompts, args.clients, args.interactive_max_tokens, 10)
        )  # warm-up
        alone = load()
        report["interactive_alone"] = alone.summary()

        batch_id = submit_batch(url, model, prompts, args.batch_lines, args.batch_max_tokens)
        report["batch_alone_output_tok_s"] = batch_window(metrics_url, args.warmup_s, args.window_s)
        cancel_batch(url, batch_id)

        batch_id = submit_batch(url, model, prompts, args.batch_lines, args.batch_max_tokens)
        time.sleep(args.warmup_s)
        start, started = runner_tokens(metrics_url), time.monotonic()
        beside = load()
        elapsed = time.monotonic() - started
        batch_tok_s = (runner_tokens(metrics_url) - start) / elapsed
        cancel_batch(url, batch_id)
        report["interactive_beside_batch"] = beside.summary()
        report["both_batch_output_tok_s"] = batch_tok_s
        report["both_interactive_output_tok_s"] = beside.output_tokens / elapsed
        report["both_total_output_tok_s"] = batch_tok_s + beside.output_tokens / elapsed
        report["ttft_p99_ratio"] = beside.summary()["ttft_p99_s"] / alone.summary()["ttft_p99_s"]
        report["total_vs_batch_alone"] = (
            report["both_total_output_tok_s"] / report["batch_alone_output_tok_s"]
        )
    finally:
        cluster.stop()
        if redis_server is not None:
            redis_server.stop()
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
